"""The trainer protocol's bodies (#29): what fuzzing it found, kept as regressions.

Over real loopback HTTP (uvicorn) to a gateway over the project's fake engine
(``helpers.gateway_rig``; its vLLM answers on another loopback port). After
every answer: no 5xx; a 4xx says why (a JSON ``error``) and changed nothing
(the controller, the journal, the engine, every lease and the open update are
as they were); a 200 report decided its update; and then the gateway still
begins, takes the report of a real transfer and publishes an update verified
to the probe level, with admission reopened. A tainted gateway is first
recovered, as an operator would (``runner.recover`` on the committed weights).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from helpers.gateway_rig import (
    AUTH,
    TOKEN,
    begin_body,
    make_parts,
    remote_transfer,
    serve_fake,
    transfer_body,
    uvicorn_thread,
)
from rolloutcore.core.lease import LeaseState
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.service import ServiceConfig, create_app
from rolloutcore.service.control import LEASE_HEADER
from rolloutcore.testing.fake import FakeRecoverer, FakeWeights, reference_tokens

MAX_BODY = 64 << 10
PROMPT = [5, 6, 7]
GEN = "/inference/v1/generate"
#: A transfer report that holds for any update whose weights were really sent.
EV: dict[str, Any] = {"completed": True, "mutation_started": True, "backend": "fake",
                      "tensors": 4, "bytes": 64, "elapsed_s": 0.01}


# ------------------------------------------------------------------------------- harness

@dataclass
class Grant:
    body: dict[str, Any]
    #: The weights this update's trainer sends (None: a fuzzed begin's, never sent).
    weights: FakeWeights | None
    transferred: bool = False

    @property
    def uid(self) -> int:
        return int(self.body["update_id"])

    @property
    def secret(self) -> str:
        return str(self.body["lease"]["secret"])

    @property
    def label(self) -> str:
        return str(self.body["target"]["label"])


@dataclass
class Proto:
    """A trainer (and an operator) talking to one gateway; the checks every test shares."""

    url: str
    client: httpx.Client
    app: Any
    fake: Any
    journal: Any
    committed: FakeWeights
    grants: dict[int, Grant] = field(default_factory=dict)
    last_final: Grant | None = None
    seeds: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)

    @property
    def gw(self) -> Any:
        return self.app.state.gateway

    @property
    def adapter(self) -> Any:
        return self.gw.runner.adapter

    def weights(self) -> FakeWeights:
        n = next(self.seeds)
        return FakeWeights.from_seed(n, step=n)

    # ---------------------------------------------------------------- calls
    def call(self, method: str, path: str, *, content: bytes = b"", json_body: Any = None,
             headers: dict[str, Any] | None = None, auth: bool = True,
             unavailable: bool = False) -> httpx.Response:
        """One call; never a 5xx (``unavailable``: the 503 of a fenced gateway expected)."""
        h: dict[str, Any] = {**(AUTH if auth else {}), **(headers or {})}
        if json_body is not None:
            content = json.dumps(json_body).encode()
            h.setdefault("content-type", "application/json")
        resp = self.client.request(method, path, content=content, headers=h)
        if unavailable:
            assert resp.status_code == 503, f"{method} {path} -> {resp.text[:500]}"
            return resp
        if path.startswith("/control/"):
            route = path if not path.startswith("/control/updates/") else (
                "/control/updates/{id}" + ("/transfer" if path.endswith("/transfer") else ""))
            self.statuses[(f"{method} {route}", resp.status_code)] += 1
        assert resp.status_code < 500, f"{method} {path} -> {resp.status_code} {resp.text[:500]}"
        return resp

    def begin(self, w: FakeWeights, **extra: Any) -> Grant:
        resp = self.call("POST", "/control/updates", json_body=begin_body(w, **extra))
        assert resp.status_code == 201, resp.text
        return self.granted(resp.json(), w)

    def granted(self, body: dict[str, Any], w: FakeWeights | None) -> Grant:
        assert isinstance(body["update_id"], int) and body["update_id"] > 0, body
        assert body["report"] == f"/control/updates/{body['update_id']}/transfer"
        assert len(body["lease"]["secret"]) >= 32 and body["lease"]["header"] == LEASE_HEADER
        g = Grant(body, w)
        self.grants[g.uid] = g
        return g

    def transfer(self, g: Grant) -> None:
        assert g.weights is not None
        remote_transfer(self.adapter, g.weights, g.label)
        g.transferred = True

    def report(self, g: Grant, body: dict[str, Any]) -> httpx.Response:
        return self.call("POST", f"/control/updates/{g.uid}/transfer", json_body=body,
                         headers={LEASE_HEADER: g.secret})

    def publish(self, g: Grant) -> dict[str, Any]:
        """The report of ``g``'s real transfer: it must publish (the lease was usable)."""
        if not g.transferred:
            self.transfer(g)
        resp = self.report(g, {"transfer": {**EV, "finish_label": g.label}})
        assert resp.status_code == 200, resp.text
        d = self.decided(resp, g)
        assert d["status"] == "published", d
        return d

    # ---------------------------------------------------------------- checks
    def state(self) -> tuple[Any, ...]:
        """Everything a refused call must leave as it was."""
        gw, e = self.gw, self.adapter.engine
        upd = gw.updates.open_update
        desc = None
        if upd is not None:
            desc = upd.describe()
            desc["lease"].pop("expires_in_s")  # the clock runs
        recs = self.journal.records
        return (gw.controller.snapshot(), recs[-1].seq if recs else 0, e.paused, e.weight_ops,
                e.label, e.weights_digest, desc, dict(gw.updates.leases.view))

    def refused(self, resp: httpx.Response, before: tuple[Any, ...], what: str = "") -> None:
        """A 4xx that says why and changed nothing."""
        assert 400 <= resp.status_code < 500, (what, resp.status_code, resp.text[:300])
        assert resp.headers["content-type"].startswith("application/json"), (what, resp.text)
        err = resp.json().get("error")
        assert isinstance(err, str) and err.strip(), (what, resp.text[:300])
        assert self.state() == before, (what, resp.status_code, resp.text[:300])

    def decided(self, resp: Any, g: Grant) -> dict[str, Any]:
        """A report's 200: its update ended in a decided state, consistent with the gateway."""
        d: dict[str, Any] = resp.json()
        assert d["update_id"] == g.uid and d["final"], d
        res = d["result"]
        c = self.gw.controller
        if d["status"] == "published":
            assert res["state"] == "READY" and res["published"]["label"] == g.label, res
            assert g.weights is not None and g.transferred, d
            self.committed = g.weights
        else:
            assert d["status"] in ("failed", "expired"), d
            assert res["classification"] in ("no_mutation", "ambiguous", "incomplete"), res
            assert (res["state"] == "READY") == (res["classification"] == "no_mutation"), res
        assert c.state.value == res["state"], (c.state, res)
        self.last_final = g
        return d

    def serves(self, w: FakeWeights) -> None:
        """Admission is open and what the data plane answers is ``w``'s, under the committed
        label (no sample is mislabelled)."""
        c = self.gw.controller
        resp = self.call("POST", GEN, json_body={"token_ids": PROMPT,
                                                 "sampling_params": {"max_tokens": 4}},
                         auth=False)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-rolloutcore-version"] == c.committed.label
        assert resp.json()["choices"][0]["token_ids"] == reference_tokens(w.digest, PROMPT, 4), \
            f"the engine does not serve the committed weights ({c.committed.label})"

    def settle(self) -> None:
        """Whatever the last answer left: a report or expiry in progress ends by itself, an
        open update is ended by its trainer (refused), a TAINTED gateway is recovered."""
        gw = self.gw
        deadline = time.monotonic() + 15
        while (u := gw.updates.open_update) is not None and u.state is not LeaseState.OPEN:
            assert time.monotonic() < deadline, f"update {u.update_id} stays {u.state.value}"
            time.sleep(0.005)
        u = gw.updates.open_update
        if u is not None:
            g = self.grants[u.update_id]
            resp = self.report(g, {"failure": {"kind": "refused", "reason": "settle"}})
            assert resp.status_code in (200, 410), resp.text  # 410: its lease ran out
            while not resp.json()["final"]:
                assert time.monotonic() < deadline, resp.text
                time.sleep(0.005)
                resp = self.call("GET", f"/control/updates/{g.uid}",
                                 headers={LEASE_HEADER: g.secret})
            self.last_final = g
        assert gw.updates.open_update is None
        c = gw.controller
        if c.state is State.TAINTED:
            # Fenced: nothing admitted, the engine paused.
            assert self.adapter.engine.paused or self.adapter.engine.dead
            self.call("GET", "/health", unavailable=True)
            self.call("POST", GEN, json_body={"token_ids": PROMPT}, auth=False, unavailable=True)
            self.gw.runner.recover(FakeRecoverer(self.adapter, self.committed))
            self.fake.engine = self.adapter.engine  # the replacement answers vLLM's routes
        assert c.state is State.READY and c.failed_closed is None, c.state
        assert not self.adapter.engine.paused
        self.serves(self.committed)

    def alive(self) -> None:
        """The property: the gateway can still begin, report and publish a real update,
        verified to the probe level, and admission reopens on the new weights."""
        self.settle()
        w = self.weights()
        g = self.begin(w, min_verification="probe")
        assert g.body["status"] == "open" and g.body["state"] == "UPDATING", g.body
        ev = remote_transfer(self.adapter, w, g.label)
        g.transferred = True
        resp = self.report(g, transfer_body(ev))
        assert resp.status_code == 200, resp.text
        d = self.decided(resp, g)
        assert d["status"] == "published", d
        res = d["result"]
        assert res["verification"]["level"] == res["verification"]["required"] == "probe", res
        c = self.gw.controller
        assert c.state is State.READY and c.committed.label == g.label
        st_ = self.call("GET", "/control/status").json()
        assert st_["update"] is None and st_["state"] == "READY", st_
        assert st_["committed"]["label"] == g.label
        self.serves(w)


@contextlib.contextmanager
def protocol() -> Iterator[Proto]:
    eng, ad, c, r, j, fake = make_parts(token_delay_s=0.0)
    up = serve_fake(fake)
    app = create_app(r, ServiceConfig(
        upstream_url=up, control_token=TOKEN, lease_s=1800, max_body_bytes=MAX_BODY,
        health_interval_s=0, client_body_s=5.0, client_send_s=5.0,
        min_verification=VerificationLevel.DECLARED))
    with uvicorn_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield Proto(url, client, app, fake, j, FakeWeights.from_seed(0))


@pytest.fixture(scope="module")
def proto() -> Iterator[Proto]:
    with protocol() as p:
        yield p


@pytest.fixture
def fresh(proto: Proto) -> Proto:
    """The module's gateway, its fake vLLM the current one, nothing open, READY."""
    serve_fake(proto.fake)
    proto.settle()
    return proto


# ------------------------------------------------- regressions: what this fuzzing found

@pytest.mark.parametrize("path", ["/control/updates/{}", "/control/updates/{}/transfer"])
@pytest.mark.parametrize("uid", ["\u00b2", "\u2460", "1\u00b2", "\u0661"])
def test_an_update_id_that_is_not_ascii_digits_is_a_404(fresh: Proto, path: str,
                                                        uid: str) -> None:
    """'\u00b2'.isdigit() holds and int('\u00b2') raises: this answered 500."""
    p = fresh
    g = p.begin(p.weights())
    before = p.state()
    method = "POST" if path.endswith("/transfer") else "GET"
    resp = p.call(method, path.format(uid), json_body={"transfer": EV} if method == "POST"
                  else None, headers={LEASE_HEADER: g.secret})
    p.refused(resp, before, uid)
    assert resp.status_code == 404
    p.publish(g)
    p.alive()


def test_a_refused_report_after_the_weights_were_sent_taints(fresh: Proto) -> None:
    """``{"failure": {"kind": "refused"}}`` after the transfer wrote the engine ended the
    update no_mutation, back in service under the old label while the engine served the
    new weights (every answer mislabelled). The engine's own weight-operation counters
    contradict the report: ambiguous, TAINTED and fenced. Nothing sent: no_mutation."""
    p = fresh
    g = p.begin(p.weights())
    p.transfer(g)
    resp = p.report(g, {"failure": {"kind": "refused", "reason": "the transport gave up"}})
    assert resp.status_code == 200, resp.text
    res = p.decided(resp, g)["result"]
    assert res["classification"] == "ambiguous" and res["state"] == "TAINTED", res
    assert "reported as refused, but the engine counted" in res["reason"], res
    assert p.adapter.engine.paused  # fenced
    p.settle()  # recovered, and serving the committed weights again
    g = p.begin(p.weights())
    resp = p.report(g, {"failure": {"kind": "refused", "reason": "nothing was sent"}})
    res = p.decided(resp, g)["result"]
    assert res["classification"] == "no_mutation" and res["state"] == "READY", res
    p.serves(p.committed)
    p.alive()


def test_a_begin_whose_source_is_not_its_target_is_a_422_before_anything_drains(
        fresh: Proto) -> None:
    """A ``source_manifest_digest`` other than the identity's drained and paused the
    engine, then answered 503 (the identity preflight refused it, as it always would)."""
    p = fresh
    w = p.weights()
    before = p.state()
    resp = p.call("POST", "/control/updates",
                  json_body=begin_body(w, source_manifest_digest="b" * 64))
    p.refused(resp, before, "source")
    assert resp.status_code == 422 and "source_manifest_digest" in resp.json()["error"]
    # The identity's own manifest, said explicitly, begins like any other.
    p.publish(p.begin(w, source_manifest_digest=w.identity().manifest_digest))
    p.alive()
