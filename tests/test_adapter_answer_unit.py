"""The answer to ``POST /control/adapters``, one engine's and a fleet's, read by one parser.

The good answers are what the gateways write (``AdapterResult.to_dict``,
``FleetAdapterResult.to_dict``); every hostile one is a good one with one thing
wrong, sent through the client (``httpx.MockTransport``) and through the trainer's
gateway engine: an ``UpdateFailed`` (ambiguous) that names what is wrong, nothing
taken as published, the trainer's adapter directory kept.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolloutcore.control.adapters import AdapterResult
from rolloutcore.core.adapters import AdapterVersion, adapter_name
from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import Provenance
from rolloutcore.errors import BadInput, UpdateFailed
from rolloutcore.fleet.adapters import FleetAdapterFailed, FleetAdapterResult, FleetAdapterVersion
from rolloutcore.service.adapter_answer import parse_adapter_answer
from rolloutcore.service.client import RolloutCoreClient

D = "7c" * 32
NAME = adapter_name(3, D)
PROV = Provenance("ckpt", "run", 2)


def _result(replica: str, diff: float, base: str = "fleet-0") -> AdapterResult:
    v = AdapterVersion(3, NAME, f"/store/{replica or 'one'}/{NAME}", D, base, 4096)
    return AdapterResult(v, (Check("listed", True, "listed"), Check("content", True, "sha256"),
                             Check("adapter-probe", True, "probe", max_abs_diff=diff,
                                   tolerance=0.05),
                             Check("base-probe", True, "base", max_abs_diff=0.001,
                                   tolerance=0.005)),
                         {"load": 0.01, "probe_adapter": 0.1}, ("rcl-1-" + "0" * 16,))


def one_engine() -> dict[str, Any]:
    return _result("", 0.002).to_dict()


def fleet() -> dict[str, Any]:
    res = FleetAdapterResult(FleetAdapterVersion(3, NAME, D, 4096, ("r0", "r1"), PROV),
                             {"r0": _result("r0", 0.002),
                              "r1": _result("r1", 0.004, base="fleet-0.1")},
                             {"prepare": 0.2, "verify": 0.3}, ("r2",))
    return json.loads(json.dumps(res.to_dict()))


def test_one_engines_answer_is_one_unnamed_acknowledgement() -> None:
    p = parse_adapter_answer(one_engine())
    assert not p.fleet and p.replicas == ("",) and p.name == NAME
    assert p.acks[""].version == _result("", 0.002).version
    assert p.probe_max_abs_diff == 0.002 and p.phases["load"] == 0.01
    assert p.acks[""].base_verified and p.acks[""].retired == ("rcl-1-" + "0" * 16,)


def test_the_fleets_answer_is_a_superset_read_by_the_same_parser() -> None:
    ans = fleet()
    # Every top-level field of the one-engine answer is there (the version's path and
    # base are each replica's: in ``replicas``).
    assert set(one_engine()) <= set(ans)
    assert set(ans["version"]) >= set(one_engine()["version"]) - {"path", "base"}
    p = parse_adapter_answer(ans)
    assert p.fleet and p.replicas == ("r0", "r1") and p.not_serving == ("r2",)
    assert p.acks["r0"].version.path == f"/store/r0/{NAME}"
    assert p.acks["r1"].version.base == "fleet-0.1"          # each replica's own base label
    assert p.probe_max_abs_diff == 0.004                    # the largest, on any replica
    merged = {c["name"]: c for c in ans["checks"]}
    assert merged["adapter-probe"]["max_abs_diff"] == 0.004
    assert merged["acknowledged"]["passed"] and "2 of the 2" in merged["acknowledged"]["detail"]
    assert "r2" in merged["acknowledged"]["detail"]
    assert ans["retired"] == ["rcl-1-" + "0" * 16] and ans["base_verified"] is True


def _drop_ack(a: dict[str, Any]) -> None:
    a["checks"] = [c for c in a["checks"] if c["name"] != "acknowledged"]


def _set(path: str, value: Any) -> Any:
    def f(a: dict[str, Any]) -> None:
        *head, last = path.split(".")
        d = a
        for k in head:
            d = d[int(k)] if isinstance(d, list) else d[k]
        d[last] = value
    return f


def _failed_probe(a: dict[str, Any]) -> None:
    a["replicas"]["r1"]["checks"][2]["passed"] = False


#: (answer maker, mutation, what the error names)
HOSTILE = [
    ("fleet", _failed_probe, "replicas.r1.checks: adapter-probe did not pass"),
    ("fleet", lambda a: a["replicas"].pop("r1"), "published only when every one did"),
    ("fleet", lambda a: a["version"]["replicas"].remove("r1"), "published only when every"),
    ("fleet", _set("members", ["r0", "r1", "r2"]), "published only when every one did"),
    ("fleet", _set("replicas.r1", {"error": "probe failed on r1"}), "probe failed on r1"),
    ("fleet", _set("replicas.r1.version.content_digest", "8d" * 32),
     "replicas.r1.version: .* is not the published"),
    ("fleet", _set("replicas.r1.version.generation", 4), "is not the published"),
    ("fleet", _drop_ack, "no passed 'acknowledged'"),
    ("fleet", _set("members", []), "members"),
    ("fleet", _set("not_serving", ["r1"]), "not_serving"),
    ("fleet", _set("version.generation", True), "version.generation"),
    ("fleet", _set("replicas.r0", fleet()), "unknown keys"),       # nested: not one engine's
    ("fleet", _set("phases.verify", -1), "phases.verify"),
    ("one", _set("version.name", "rcl-3-" + "0" * 16), "version.name"),
    ("one", lambda a: a["checks"].pop(1), "no content check"),
    ("one", lambda a: a["checks"].pop(3), "base_verified"),
    ("one", _set("checks", "all passed"), "list of checks"),
    ("one", _set("checks.0.passed", "yes"), "passed a bool"),
    ("one", _set("extra", 1), "unknown keys"),
    ("one", _set("replicas", {}), "members"),
    ("one", lambda a: a["version"].pop("base"), "AdapterVersion"),
]


def _mutated(kind: str, mutate: Any) -> Any:
    a = copy.deepcopy(fleet() if kind == "fleet" else one_engine())
    mutate(a)
    return a


@pytest.mark.parametrize(("kind", "mutate", "said"), HOSTILE)
def test_a_hostile_answer_is_refused_naming_what_is_wrong(kind: str, mutate: Any,
                                                          said: str) -> None:
    with pytest.raises(BadInput, match=said):
        parse_adapter_answer(_mutated(kind, mutate))


@pytest.mark.parametrize("body", [[], "published", None, 3])
def test_not_an_object_is_refused(body: Any) -> None:
    with pytest.raises(BadInput, match="JSON object"):
        parse_adapter_answer(body)


class _Gateway:
    def __init__(self, status: int, body: Any) -> None:
        self.status, self.body = status, body
        self.posts = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/control/adapters" and request.method == "POST":
            self.posts += 1
        return httpx.Response(self.status, json=self.body)


def _adapter_dir(tmp_path: Path) -> Path:
    d = tmp_path / "a"
    d.mkdir(exist_ok=True)
    (d / "adapter_config.json").write_text("{}")
    return d


@pytest.mark.parametrize(("kind", "mutate", "said"), HOSTILE[:8] + HOSTILE[13:15])
def test_the_client_takes_a_hostile_200_as_an_ambiguous_failure(
        tmp_path: Path, kind: str, mutate: Any, said: str) -> None:
    gw = _Gateway(200, _mutated(kind, mutate))
    c = RolloutCoreClient("http://gw.test", "t" * 20, http_transport=httpx.MockTransport(gw))
    with pytest.raises(UpdateFailed, match="not taken as published") as exc:
        c.update_adapter(_adapter_dir(tmp_path), PROV)
    assert exc.value.classification == "ambiguous" and gw.posts == 1
    assert said.split(":")[0].split(" ")[0] in str(exc.value)


def test_the_client_reads_both_good_answers_and_a_fleets_409(tmp_path: Path) -> None:
    d = _adapter_dir(tmp_path)
    for body, fleet_ in ((one_engine(), False), (fleet(), True)):
        c = RolloutCoreClient("http://gw.test", "t" * 20,
                              http_transport=httpx.MockTransport(_Gateway(200, body)))
        got = c.update_adapter(d, PROV)
        assert got.name == NAME and got.fleet is fleet_
    failed = FleetAdapterFailed(NAME, {"r0": "verified, not published: refused",
                                       "r1": "failed (UpdateFailed: probe)"}, "no_mutation")
    c = RolloutCoreClient("http://gw.test", "t" * 20, http_transport=httpx.MockTransport(
        _Gateway(409, failed.to_dict())))
    with pytest.raises(UpdateFailed, match="r1: failed") as exc:
        c.update_adapter(d, PROV)
    assert exc.value.classification == "no_mutation"


class _FleetGateway:
    """A fleet gateway's status, adapters and publish routes, for the trainer's engine."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def __call__(self, req: httpx.Request) -> httpx.Response:
        from helpers.trajtools import IDENTITY, version

        if req.url.path == "/control/status":
            return httpx.Response(200, json={
                "newest": {"generation": 0, "label": "fleet-0",
                           "identity_digest": IDENTITY.digest},
                "serving": 2, "replicas": [
                    {"name": n, "in_pool": True, "fleet_generation": 0,
                     "engine_version": version(1).to_dict()} for n in ("r0", "r1")]})
        if req.url.path == "/control/adapters" and req.method == "GET":
            return httpx.Response(200, json={"current": None, "replicas": {}, "base": {
                "generation": 0, "label": "fleet-0", "identity": IDENTITY.to_dict()}})
        return httpx.Response(200, json=self.answer)


class _Peft:
    def __init__(self) -> None:
        self.saved: list[Path] = []

    def save_pretrained(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_config.json").write_text("{}")
        self.saved.append(out)


@pytest.mark.parametrize("answer", [_mutated("fleet", _failed_probe),
                                    _mutated("fleet", lambda a: a["replicas"].pop("r1")),
                                    one_engine()])
def test_the_trainers_engine_publishes_nothing_on_a_bad_fleet_answer(
        tmp_path: Path, answer: Any) -> None:
    """A replica failed, a replica missing, or one engine's answer from a fleet: nothing
    published for the trainer, its directory kept; the good answer publishes each
    replica's copy."""
    from rolloutcore.integrations.trl.engines import FLEET_EPOCH, _GatewayEngine

    gw = _FleetGateway(answer)
    eng = _GatewayEngine("http://gw.test", "t" * 32, transport=None, data_token=None,
                         timeout_s=5, min_verification=None, adapters=True,
                         adapter_dir=tmp_path / "sent", http_transport=httpx.MockTransport(gw))
    try:
        v, _ = eng.committed()
        assert (v.label, v.engine_epoch) == ("fleet-0", FLEET_EPOCH) and eng.fleet is not None
        model = _Peft()
        with pytest.raises(UpdateFailed, match=r"ambiguous|not taken as published"):
            eng.update_adapter(model, PROV)
        assert eng.published == {} and model.saved[0].exists()
        gw.answer = fleet()
        pub = eng.update_adapter(model, PROV)
        assert set(pub.adapters) == {"r0", "r1"} and pub.probe_max_abs_diff == 0.004
        assert {n: set(m) for n, m in eng.published.items()} == {"r0": {NAME}, "r1": {NAME}}
        assert eng.published["r1"][NAME].base == "fleet-0.1"
        assert not model.saved[1].exists()
    finally:
        eng.close()
