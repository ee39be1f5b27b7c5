"""``train --lora --gateway``'s engine without an engine: the gateway LoRA engine
(``_GatewayEngine(adapters=True)``) over an ``httpx.MockTransport`` standing for a
``serve --lora`` gateway: how it publishes (save, ``POST /control/adapters``, the
directory removed), how a refusal or an unexpected answer stops it, and how it reads
the adapter version each answer names (``answer_adapter``).

The run itself through a real ``serve --lora`` is
tests/engine/test_trl_lora_gateway_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.trajtools import IDENTITY, version
from rolloutcore.core.adapters import AdapterVersion, adapter_name
from rolloutcore.core.versions import Provenance
from rolloutcore.errors import BadInput, EffectError, UpdateFailed, UpdateRefused
from rolloutcore.integrations.trl.engines import _GatewayEngine, answer_adapter
from rolloutcore.integrations.trl.rollout import _adapter_problem
from rolloutcore.provenance.trajectory import SamplingSpec

URL = "http://gw.test"
BASE = version(1)
D1, D2 = "1a" * 32, "2b" * 32
SPEC = SamplingSpec(1.0, max_tokens=2)


def _version(gen: int, digest: str, store: Path) -> AdapterVersion:
    name = adapter_name(gen, digest)
    return AdapterVersion(gen, name, str(store / name), digest, BASE.label, 1234)


class FakeLoraGateway:
    """What a ``serve --lora`` gateway answers: status, the adapter route, generate."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.current: AdapterVersion | None = None
        self.sent: list[dict[str, Any]] = []   # POST /control/adapters bodies
        self.generated: list[dict[str, Any]] = []
        self.publish_answer: tuple[int, Any] | None = None   # None: publish
        self.answer_as: AdapterVersion | None = None   # answer naming another version
        self.header_name: str | None = None           # a header disagreeing with the body

    def handler(self, req: httpx.Request) -> httpx.Response:
        path = req.url.path
        if path == "/control/status":
            return httpx.Response(200, json={"state": "READY", "committed": BASE.to_dict(),
                                             "identity": IDENTITY.to_dict()})
        if path == "/control/adapters" and req.method == "POST":
            body = json.loads(req.content)
            body["files"] = sorted(p.name for p in Path(body["adapter_dir"]).iterdir())
            self.sent.append(body)
            if self.publish_answer is not None:
                return httpx.Response(self.publish_answer[0], json=self.publish_answer[1])
            self.current = _version(len(self.sent), (D1, D2)[len(self.sent) % 2], self.store)
            return httpx.Response(200, json={
                "version": self.current.to_dict(), "phases": {"load": 0.5, "verify": 0.25},
                "checks": [{"name": "listed", "passed": True, "max_abs_diff": None},
                           {"name": "content", "passed": True},
                           {"name": "adapter-probe", "passed": True, "max_abs_diff": 0.01},
                           {"name": "base-probe", "passed": True, "max_abs_diff": 0.0}],
                "retired": [], "notes": [], "base_verified": True})
        if path == "/inference/v1/generate":
            body = json.loads(req.content)
            self.generated.append(body)
            info: dict[str, Any] = {"generation": BASE.generation, "version": BASE.label,
                                    "engine_epoch": BASE.engine_epoch,
                                    "identity_digest": IDENTITY.digest, "rollout_id": "r"}
            headers = {}
            a = self.answer_as or self.current
            if a is not None:
                info.update(adapter=a.name, adapter_generation=a.generation,
                            adapter_digest=a.content_digest, adapter_base=a.base)
                headers = {"x-rolloutcore-adapter": self.header_name or a.name,
                           "x-rolloutcore-adapter-digest": a.content_digest}
            return httpx.Response(200, headers=headers, json={"rolloutcore": info, "choices": [
                {"token_ids": [7, 8], "finish_reason": "length",
                 "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}]})
        return httpx.Response(404, json={"error": "no route"})


class FakePeft:
    """A PEFT model as far as the engine sees it: ``save_pretrained``."""

    def __init__(self) -> None:
        self.saved: list[Path] = []

    def save_pretrained(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_config.json").write_text('{"r": 4}')
        (out / "adapter_model.safetensors").write_bytes(b"x")
        self.saved.append(out)


@pytest.fixture
def gw(tmp_path: Path) -> Any:
    fake = FakeLoraGateway(tmp_path / "gateway-store")
    eng = _GatewayEngine(URL, "t" * 32, transport=None, data_token=None, timeout_s=5,
                         min_verification=None, adapters=True,
                         adapter_dir=tmp_path / "sent",
                         http_transport=httpx.MockTransport(fake.handler),
                         probe_tolerance=0.05)
    yield fake, eng, tmp_path / "sent"
    eng.close()


def test_bad_gateway_engine_input_is_refused(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"transport": None, "data_token": None, "timeout_s": 5,
                          "min_verification": None}
    with pytest.raises(BadInput, match="adapter_dir is for adapters=True"):
        _GatewayEngine(URL, "t", adapter_dir=tmp_path, **kw)
    with pytest.raises(BadInput, match="public_model"):
        _GatewayEngine(URL, "t", adapters=True, public_model="", **kw)
    full = _GatewayEngine(URL, "t", **kw)
    try:
        with pytest.raises(BadInput, match="not set up for adapters"):
            full.update_adapter(FakePeft(), Provenance("c", "r", 1))
    finally:
        full.close()


def test_an_adapter_is_saved_published_through_the_client_and_its_directory_removed(
        gw: Any) -> None:
    fake, eng, sent = gw
    model = FakePeft()
    pub = eng.update_adapter(model, Provenance("ckpt", "run", 3), "bfloat16")
    body = fake.sent[0]
    assert body["probe_tolerance"] == 0.05  # declared by the trainer, as for full updates
    assert Path(body["adapter_dir"]).parent == sent.resolve()
    assert Path(body["adapter_dir"]).name.startswith("step3-")
    assert body["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert body["provenance"] == {"checkpoint": "ckpt", "trainer_run": "run", "step": 3}
    assert not model.saved[0].exists()            # the gateway holds its own copy
    assert pub.adapter == fake.current and pub.version == BASE
    assert pub.identity.digest == IDENTITY.digest
    assert pub.probe_max_abs_diff == 0.01 and pub.phases_s == {"load": 0.5, "verify": 0.25}
    assert eng.published == {"": {pub.adapter.name: pub.adapter}}
    assert pub.adapters == {"": pub.adapter}
    with pytest.raises(BadInput, match="never the base"):
        eng.update({}, Provenance("ckpt", "run", 4), None, "trl")


@pytest.mark.parametrize(("answer", "raised", "said"), [
    ((409, {"error": "another update runs", "refused": True}), UpdateRefused, "another"),
    ((409, {"error": "probe failed", "phase": "verify", "classification": "clean"}),
     UpdateFailed, "probe failed"),
    ((400, {"error": "rank 32 > 8"}), BadInput, "rank 32"),
    ((500, {"error": "boom"}), UpdateFailed, "boom"),
    ((200, {"version": {"name": "x"}}), UpdateFailed, "not taken as published"),
])
def test_a_refused_failed_or_unreadable_publish_raises_and_publishes_nothing(
        gw: Any, answer: tuple[int, Any], raised: type[Exception], said: str) -> None:
    fake, eng, _ = gw
    fake.publish_answer = answer
    model = FakePeft()
    with pytest.raises(raised, match=said):
        eng.update_adapter(model, Provenance("ckpt", "run", 1))
    assert eng.published == {}
    assert model.saved[0].exists()   # kept: the gateway may still be reading it


def test_generation_asks_for_policy_and_takes_the_adapter_its_answer_names(gw: Any) -> None:
    fake, eng, _ = gw
    pub = eng.update_adapter(FakePeft(), Provenance("ckpt", "run", 0))
    eng.committed()
    s = eng.generate("g/0", [1, 2, 3], SPEC)
    assert fake.generated[0]["model"] == "policy"
    assert s.adapter == pub.adapter and s.adapter is not None
    assert s.adapter.path == pub.adapter.path          # the published version, as recorded
    assert s.binding.version == BASE and s.token_ids == (7, 8) and s.attributable
    assert _adapter_problem(s, {"": pub.adapter}) is None
    # the answer names a version the gateway did not publish for this step: refused
    fake.answer_as = _version(9, D2, fake.store)
    other = eng.generate("g/1", [1, 2, 3], SPEC)
    assert other.adapter is not None and other.adapter.name == fake.answer_as.name
    assert other.adapter.path == f"gateway:{fake.answer_as.name}"
    assert "but this step's adapter is" in str(_adapter_problem(other, {"": pub.adapter}))
    # the same name and generation, other content: not the published one
    assert pub.adapter is not None
    fake.answer_as = AdapterVersion(pub.adapter.generation, pub.adapter.name, "p", "3c" * 32,
                                    BASE.label)
    same_name = eng.generate("g/2", [1, 2, 3], SPEC)
    assert _adapter_problem(same_name, {"": pub.adapter}) is not None
    # no adapter named (the base answered)
    fake.answer_as, fake.current = None, None
    base = eng.generate("g/3", [1, 2, 3], SPEC)
    assert base.adapter is None
    assert _adapter_problem(base, {"": pub.adapter}) == "generated without an adapter in a LoRA run"


def test_an_answer_whose_headers_disagree_with_its_body_is_refused(gw: Any) -> None:
    fake, eng, _ = gw
    eng.update_adapter(FakePeft(), Provenance("ckpt", "run", 0))
    fake.header_name = "rcl-7-0000000000000000"
    with pytest.raises(EffectError, match="unexpected gateway answer"):
        eng.generate("g/0", [1], SPEC)


def test_answer_adapter_reads_what_the_gateway_says_and_refuses_half_an_answer(
        tmp_path: Path) -> None:
    a = _version(2, D1, tmp_path)
    info = {"adapter": a.name, "adapter_generation": 2, "adapter_digest": D1,
            "adapter_base": BASE.label}
    hdr = {"x-rolloutcore-adapter": a.name, "x-rolloutcore-adapter-digest": D1}
    assert answer_adapter({}, {}, {a.name: a}) is None
    assert answer_adapter(info, hdr, {a.name: a}) is a
    unknown = answer_adapter(info, hdr, {})
    assert unknown is not None and unknown != a and unknown.path == f"gateway:{a.name}"
    other_base = answer_adapter({**info, "adapter_base": "rc-9"}, hdr, {a.name: a})
    assert other_base is not None and other_base.base == "rc-9" and other_base != a
    for bad_info, bad_hdr, said in (
            ({}, hdr, "only in part"),
            ({"adapter_digest": D1}, {}, "only in part"),
            (info, {}, "headers name"),
            (info, {**hdr, "x-rolloutcore-adapter-digest": D2}, "headers name"),
            ({**info, "adapter_generation": "2"}, hdr, "not an int"),
            ({**info, "adapter_generation": True}, hdr, "not an int"),
            ({**info, "adapter_digest": "zz"}, {**hdr, "x-rolloutcore-adapter-digest": "zz"},
             "sha256"),
            ({k: v for k, v in info.items() if k != "adapter_base"}, hdr, "adapter_base")):
        with pytest.raises((BadInput, KeyError), match=said):
            answer_adapter(bad_info, bad_hdr, {a.name: a})


def test_train_lora_gateway_without_a_token_exits_2_before_anything_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from rolloutcore.cli import main

    monkeypatch.delenv("ROLLOUTCORE_TOKEN", raising=False)
    work = tmp_path / "w"
    rc = main(["train", "--lora", "--gateway", "http://127.0.0.1:9", "--workdir", str(work),
               "--quiet"])
    assert rc == 2 and "needs the gateway's control token" in capsys.readouterr().err
    assert not work.exists()


def test_the_summary_says_which_journal_the_audit_read() -> None:
    from rolloutcore.cli.train import _journal_line

    assert _journal_line({"journal": "/j.jsonl", "gateway": "http://gw"}) == \
        "journal: /j.jsonl"
    assert _journal_line({"journal": "/w/journal.jsonl", "gateway": None}) == \
        "journal: /w/journal.jsonl"
    lora = _journal_line({"journal": None, "gateway": "http://gw", "lora": {"rank": 4}})
    assert lora.startswith("journal: none") and "--journal" in lora
    assert "against the version the gateway answered" in lora
    full = _journal_line({"journal": None, "gateway": "http://gw", "lora": None})
    assert "not checked against the commits" in full
