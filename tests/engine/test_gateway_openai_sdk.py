"""The gateway as a drop-in OpenAI endpoint, and TRL training through it.

``rolloutcore serve`` with its embedded default (a generated tiny checkpoint,
vLLM launched on it) in its own process; the official ``openai`` SDK as the
client: the model list, completions, chat, streaming, and the SDK's own
retry on ``503`` + ``Retry-After`` while an update holds admission closed.
Then a short GRPO training with ``RolloutCoreRollout.through_gateway``:
updates through the gateway's two-phase protocol, generation through its
data plane.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import stop_group
from helpers.fault_matrix import PromiseRows
from rolloutcore.control.journal import read_journal
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.process import free_port, vllm_available
from rolloutcore.provenance.audit import audit_file
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.service.client import RolloutCoreClient
from rolloutcore.testing.models import make_checkpoint
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")

TOKEN = "openai-sdk-test-token-0123456789abcdef"
#: Fault-matrix rows (with ROLLOUTCORE_FAULT_MATRIX set: helpers.fault_matrix).
MATRIX = PromiseRows(
    "tests/engine/test_gateway_openai_sdk.py",
    engines="one real vLLM (CPU build) launched by `rolloutcore serve` (its embedded default: a "
            "generated tiny checkpoint; dev and weight routes behind the per-launch route key, "
            "transports.engine_key), the gateway in its own process",
    engine="vLLM, launched")
_fault_matrix = MATRIX.fixture()
ROOT = Path(__file__).resolve().parents[2]
VERSION = "x-rolloutcore-version"


@dataclass
class Served:
    url: str
    work: Path
    journal: Path
    proc: subprocess.Popen[bytes]

    @property
    def checkpoint(self) -> Path:
        return self.work / "policy-0"  # what the embedded default generates

    def sdk(self, **kw: Any) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", **kw)

    def control(self) -> RolloutCoreClient:
        return RolloutCoreClient(self.url, TOKEN, transport=GlooTransport())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("serve")
    (work / "token").write_text(TOKEN + "\n")
    port = free_port()
    log = work / "serve.log"
    cmd = [sys.executable, "-m", "rolloutcore", "serve", "--workdir", str(work),
           "--port", str(port), "--token-file", str(work / "token"),
           "--journal", str(work / "journal.jsonl")]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # generates a checkpoint and cold-starts vLLM
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        yield Served(url, work, work / "journal.jsonl", proc)
    finally:
        stop_group(proc, 60)


@pytest.fixture
def client(served: Served) -> Iterator[Any]:
    with served.sdk() as c:
        yield c


def test_the_model_list_answers_like_vllm(client: Any) -> None:
    models = client.models.list()
    assert [(m.id, m.owned_by) for m in models.data] == [("policy", "vllm")]
    assert models.data[0].model_extra["max_model_len"] == 512  # vLLM's own answer


def _model(client: Any) -> str:
    return str(client.models.list().data[0].id)


def test_completions_carry_the_version(client: Any) -> None:
    raw = client.completions.with_raw_response.create(model=_model(client), prompt="Hello",
                                                      max_tokens=8, temperature=0)
    done = raw.parse()
    assert done.choices[0].text is not None and done.usage.completion_tokens > 0
    assert raw.headers[VERSION] == done.model_extra["rolloutcore"]["version"]


def test_chat_works_with_the_generated_tokenizer_s_template(client: Any) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=_model(client), messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        temperature=0)
    done = raw.parse()
    assert isinstance(done.choices[0].message.content, str)
    assert done.usage.prompt_tokens == len(b"<s><|user|>\nHi\n<|assistant|>\n") - 2
    assert raw.headers[VERSION] == done.model_extra["rolloutcore"]["version"]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_streaming_carries_the_version_in_its_first_event(client: Any, kind: str) -> None:
    m = _model(client)
    if kind == "completions":
        stream = client.completions.create(model=m, prompt="Hello", max_tokens=12,
                                           temperature=0, stream=True)
    else:
        stream = client.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
            temperature=0, stream=True)
    chunks = list(stream)
    assert len(chunks) >= 2
    info = chunks[0].model_extra["rolloutcore"]
    assert info["version"] and info["rollout_id"]
    assert all("rolloutcore" not in (c.model_extra or {}) for c in chunks[1:])


@pytest.mark.slow  # a GRPO run (test_trl_loop.py is the CI lane's TRL run): the slow lane
def test_trl_trains_through_the_gateway(served: Served, tmp_path: Path) -> None:
    """``--gateway`` mode: every update is the gateway's, every sample its data plane's."""
    import torch
    import transformers

    from rolloutcore.cli.train import target_reward
    from rolloutcore.integrations.trl import RolloutCoreRollout, import_trl

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trl = import_trl()
    from datasets import Dataset

    traj = tmp_path / "traj.jsonl"
    rollout = RolloutCoreRollout.through_gateway(served.url, TOKEN,
                                                 checkpoint=served.checkpoint,
                                                 run="via-gateway", trajectories=traj)
    v0 = rollout.version
    seen: list[tuple[int, set[str]]] = []

    def reward(prompts: Any, completions: Any, completion_ids: list[list[int]],
               trainer_state: Any, rc_version: list[str], **kw: Any) -> list[float]:
        seen.append((int(trainer_state.global_step), set(rc_version)))
        return target_reward(completion_ids)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(served.checkpoint)
        model = transformers.AutoModelForCausalLM.from_pretrained(served.checkpoint,
                                                                  dtype=torch.float32)
        args = trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, seed=0,
            per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
            learning_rate=2e-3, max_steps=2, logging_steps=1, report_to="none",
            save_strategy="no", disable_tqdm=True, log_level="error",
            gradient_checkpointing=False)
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=reward, args=args,
            train_dataset=Dataset.from_dict({"prompt": [f"say a ({i})" for i in range(16)]}),
            processing_class=tok, rollout_func=rollout)
        trainer.train()
    finally:
        torch.set_num_threads(threads)
        rollout.close()
    (upd,) = rollout.updates
    assert seen == [(0, {v0.label}), (1, {upd.version.label})]
    assert upd.version.generation == v0.generation + 1
    assert upd.identity.provenance == Provenance(str(served.checkpoint.resolve()),
                                                 "via-gateway", 1)
    commits = [r for r in read_journal(served.journal) if r.kind == "commit"]
    assert commits[-1].data["version"]["label"] == upd.version.label
    groups = list(read_groups(traj))
    assert len(groups) == 4 and {s.engine.replica for g in groups for s in g.samples} == {
        served.url}
    assert {s.engine.vllm_version for g in groups for s in g.samples} != {"unknown"}
    rep = audit_file(traj, served.journal)
    assert rep.purity.ok and rep.purity.with_spans == 16, rep.format_table()


_OUT_OF_BAND = r"""
import json, sys, httpx
url = sys.argv[1]
calls = [("POST", "/pause", None), ("POST", "/update_weight_version", {"version": "rc-evil"}),
         ("POST", "/reset_prefix_cache", None), ("POST", "/start_weight_update", None),
         ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
         ("POST", "/collective_rpc", {"method": "reset"}), ("POST", "/sleep", None),
         ("GET", "/weight_info", None), ("GET", "/server_info", None)]
out = {p: httpx.request(m, url + p, json=b, timeout=60).status_code for m, p, b in calls}
out["is_paused"] = httpx.get(url + "/is_paused", timeout=60).json()["is_paused"]
out["generate"] = httpx.post(url + "/v1/completions", timeout=120, json={
    "model": "policy", "prompt": "Hi", "max_tokens": 2, "temperature": 0}).status_code
print(json.dumps(out))
"""


def test_a_local_process_cannot_write_to_the_engine_the_gateway_launched(
        served: Served) -> None:
    """Issue 29: the dev and weight routes of a launched engine need its route key.

    Another local process that knows the engine's URL (from the gateway's status)
    but not its key is refused (403) on every dev route, before vLLM acts: the
    engine stays unpaused on its label, and generating stays open.
    """
    auth = {"authorization": f"Bearer {TOKEN}"}
    st = httpx.get(f"{served.url}/control/status", headers=auth, timeout=30).json()
    assert st["engine"]["route_guard"] is True
    assert "route_key" not in str(st)  # the key only in a begin's grant
    committed = st["committed"]["label"]
    r = subprocess.run([sys.executable, "-c", _OUT_OF_BAND, st["engine"]["base_url"]],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    refused = {k: v for k, v in got.items() if k.startswith("/")}
    assert set(refused.values()) == {403}, got
    assert got["is_paused"] is False and got["generate"] == 200, got
    # Nothing changed behind the gateway: its committed label still answers.
    after = httpx.get(f"{served.url}/control/status", headers=auth, timeout=30).json()
    assert after["state"] == "READY" and not after["failed_closed"], after
    assert after["committed"]["label"] == committed
    with served.sdk() as c:
        raw = c.completions.with_raw_response.create(model=_model(c), prompt="Hello",
                                                     max_tokens=4, temperature=0)
    assert raw.headers[VERSION] == committed
    log = (served.work / "serve.log").read_text()
    assert "was not launched by RolloutCore" not in log
    recs = read_journal(served.journal)
    assert [r for r in recs if r.kind == "taint"] == [] and check_journal(recs) == []
    version = httpx.get(st["engine"]["base_url"] + "/version", timeout=30).json()["version"]
    MATRIX.row("out_of_band_write_launched_engine",
               "another local process, with the engine's URL (from the gateway's status) but "
               f"not its route key, calls {len(refused)} dev and weight routes of the engine "
               "`rolloutcore serve` launched (pause, a label, cache reset, weight transfer, "
               "collective_rpc, sleep, weight and server info)",
               f"{len(refused)} x 403 before vLLM acts: not paused, label unchanged, no taint; "
               "generating stays open, the next answer carries the committed label", "READY",
               engine=f"vLLM {version}, launched (route guard)", refused=refused,
               published_unvalidated=0, mislabeled_answers=0)


def test_the_route_key_lent_to_a_trainer_ends_with_its_lease(served: Served,
                                                             tmp_path: Path) -> None:
    """#47: the key a grant lends the trainer opens the launched vLLM's weight routes for
    that lease only. After the trainer's update is published, and after a lease that
    ran out without a report, a call with its key is refused by the engine's route
    guard (403) and changes nothing: not paused, the committed label answers."""
    from rolloutcore.service.client import identity_of, probe_for
    from rolloutcore.transports.engine_key import HEADER

    auth = {"authorization": f"Bearer {TOKEN}"}
    target = make_checkpoint(tmp_path / "lent", 12)
    src = WeightSource.from_checkpoint(target)
    grants: list[Any] = []
    with served.control() as rc:
        real_begin = rc.begin

        def begin(*a: Any, **kw: Any) -> Any:
            grants.append(real_begin(*a, **kw))
            return grants[-1]

        rc.begin = begin  # type: ignore[method-assign]
        res = rc.update(src, Provenance("lent", "lease", 1), owner="lent-key-test")
        assert res.published is not None
        g = rc.begin(identity_of(src, Provenance("lent", "lease", 2)), owner="lent-key-test",
                     lease_s=3, probe=probe_for(src))
        engine = g.engine_url
        assert g.route_key is not None and g.route_key != grants[0].route_key
        # In its lease the key opens a guarded route (a read: nothing changes).
        assert httpx.get(f"{engine}/server_info", headers={HEADER: g.route_key},
                         timeout=30).status_code == 200
        done = rc.wait(g, 120)
    assert done.final and done.status == "expired", done
    ended = {"published": grants[0].route_key, "expired": g.route_key}
    refused: dict[str, int] = {}
    for why, key in ended.items():
        for path in ("/pause", "/update_weight_version", "/collective_rpc", "/server_info"):
            r = httpx.post(f"{engine}{path}", headers={HEADER: key}, json={}, timeout=30) \
                if path != "/server_info" else httpx.get(f"{engine}{path}",
                                                         headers={HEADER: key}, timeout=30)
            refused[f"{why} {path}"] = r.status_code
    assert set(refused.values()) == {403}, refused
    assert httpx.get(f"{engine}/is_paused", timeout=30).json()["is_paused"] is False
    st = httpx.get(f"{served.url}/control/status", headers=auth, timeout=30).json()
    assert st["state"] == "READY" and st["committed"]["label"] == res.published.label
    with served.sdk() as c:
        raw = c.completions.with_raw_response.create(model=_model(c), prompt="Hello",
                                                     max_tokens=4, temperature=0)
    assert raw.headers[VERSION] == res.published.label
    MATRIX.row("route_key_after_lease",
               "a trainer calls the launched vLLM's weight routes with the route key it was "
               "lent, after its update was published and after a lease that ran out",
               f"{len(refused)} x 403 by the engine's route guard: not paused, label "
               "unchanged, the committed label answers", "READY",
               refused=refused, published_unvalidated=0, mislabeled_answers=0)


def test_the_sdk_retries_503_with_retry_after_during_an_update(served: Served,
                                                               tmp_path: Path) -> None:
    """An update holds admission closed; the SDK's own retry gets the answer after it."""
    target = make_checkpoint(tmp_path / "next", 11)
    src = WeightSource.from_checkpoint(target)
    statuses: list[tuple[int, str | None, str | None]] = []
    refused = threading.Event()

    def on_response(resp: Any) -> None:
        statuses.append((resp.status_code, resp.headers.get("retry-after"),
                         resp.headers.get("x-should-retry")))
        if resp.status_code == 503:
            refused.set()

    http = httpx2.Client(event_hooks={"response": [on_response]})
    client = served.sdk(max_retries=20, timeout=120, http_client=http)
    m = _model(client)
    statuses.clear()
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["raw"] = client.completions.with_raw_response.create(
                model=m, prompt="Hello", max_tokens=4, temperature=0)
        except BaseException as exc:
            out["error"] = exc

    tr = GlooTransport()

    def transfer_after_a_refusal(grant: Any, source: Any) -> Any:
        th = threading.Thread(target=call)
        th.start()
        out["thread"] = th
        assert refused.wait(60), f"no 503 seen: {statuses}"
        tr.connect(grant.engine_url, timeout_s=120)
        return tr.send(grant.engine_url, grant.target.label, source, timeout_s=120)

    with served.control() as rc:
        res = rc.update(src, Provenance("next", "sdk-retry", 1), owner="sdk-test",
                        transfer=transfer_after_a_refusal)
    tr.close()
    out["thread"].join(120)
    client.close()
    http.close()
    assert "error" not in out, repr(out.get("error"))
    assert res.published is not None
    raw = out["raw"]
    assert raw.headers[VERSION] == res.published.label
    first = statuses[0]
    assert first == (503, "1", "true"), statuses
    assert statuses[-1][0] == 200 and len(statuses) >= 2
