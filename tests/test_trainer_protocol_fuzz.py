"""Fuzzing the trainer protocol's bodies (#29): after every answer the gateway still updates.

The trainer protocol (``service.control``: begin, report a transfer or a failure,
poll an update, the status) over real loopback HTTP (uvicorn) to a gateway over
the project's fake engine (``helpers.gateway_rig``; its vLLM answers on another
loopback port), fuzzed three ways:

* schemathesis, from the control API's own OpenAPI document, positive and
  negative cases of every operation; the update-scoped calls are aimed, mostly,
  at a live update with its real lease (the rest keep the generated id or lease:
  forged);
* hypothesis bodies for the report, sent with a live lease: wrong types,
  unknown fields, a sent checksum with repeated names or values not one per
  name, huge and deep JSON, NaN, invalid UTF-8, duplicate keys, wrong content
  types, forged, stale and malformed update ids and lease secrets; and for the
  begin, with or without another update open;
* hypothesis sequences of protocol calls in any order (report before begin,
  publish twice, report after the lease ran out, begin while one is open, the
  same begin again, a forged lease, a stale update).

After every answer: no 5xx; a 4xx says why (a JSON ``error``) and changed
nothing (the controller, the journal, the engine, every lease and the open
update are as they were); a 200 report decided its update (published; or
no_mutation, back in service on the weights the engine really holds; or
TAINTED and fenced); and then the gateway still begins, takes the report of a
real transfer and publishes an update verified to the probe level, with
admission reopened (the data plane answers with the new weights' tokens under
the new label). A tainted gateway is first recovered, as an operator would
(``runner.recover`` with a replacement engine on the committed weights).

The gateway's floor is ``declared`` so that fuzzed begins get past the floor;
the liveness update asks for ``probe`` itself. Fast lane: derandomized, a few
dozen examples each; ``ROLLOUTCORE_FUZZ_SCALE=k`` runs k times as many, and
``ROLLOUTCORE_FUZZ_COVERAGE=1`` adds schemathesis' coverage phase (every
boundary and type of every field: about 600 more cases, each followed by an
update).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers.fuzzing import json_value
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
#: More examples with ROLLOUTCORE_FUZZ_SCALE=k (k times each test's count).
SCALE = float(os.environ.get("ROLLOUTCORE_FUZZ_SCALE", "1"))
PROMPT = [5, 6, 7]
GEN = "/inference/v1/generate"
#: A transfer report that holds for any update whose weights were really sent.
EV: dict[str, Any] = {"completed": True, "mutation_started": True, "backend": "fake",
                      "tensors": 4, "bytes": 64, "elapsed_s": 0.01}
#: A begin for weights nobody sends (the fuzzed begins' base).
FOREIGN = FakeWeights.from_seed(9999, step=9999)


def _key(w: FakeWeights) -> str:
    """A begin_key for ``w``'s begin (the same begin sent again carries the same one)."""
    return f"key-{w.digest[:16]}"


def _n(base: int) -> int:
    return max(1, round(base * SCALE))


def _settings(examples: int) -> Any:
    return settings(max_examples=_n(examples), deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


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


@dataclass(repr=False)
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

    def __repr__(self) -> str:  # hypothesis prints a test's arguments, fixtures included
        return f"Proto({self.url}, {len(self.grants)} updates)"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # (its pretty-printer)
        printer.text(repr(self))

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


# ---------------------------------------------------------------------- body strategies

@dataclass(frozen=True)
class Body:
    """Raw bytes with their content type; ``what`` says how they were made."""

    what: str
    raw: bytes
    ctype: str | None = "application/json"

    def headers(self) -> dict[str, str]:
        return {} if self.ctype is None else {"content-type": self.ctype}

    def __repr__(self) -> str:  # what hypothesis prints of a failing example
        return f"Body({self.what[:300]!r}, {len(self.raw)} bytes, {self.ctype!r})"


def _js(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


_CTYPES = st.sampled_from(["application/json"] * 8 + [
    "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain", "application/jsonx",
    "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "", None])
_names = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1,
                 max_size=8)
_values = st.integers(0, 2**63 - 1) | st.none()


@st.composite
def sent_checksums(draw: st.DrawFn) -> dict[str, Any]:
    """A transport's checksum of what it sent: repeated names, values not one per name,
    wrong schemes and values, or well formed (this engine cannot compare any)."""
    kind = draw(st.sampled_from(["repeat", "count", "ok", "scheme", "value", "empty", "extra"]))
    names = draw(st.lists(_names, min_size=1, max_size=5, unique=True))
    values = draw(st.lists(_values, min_size=len(names), max_size=len(names)))
    sc: dict[str, Any] = {"scheme": "rc_cuda_ipc/block", "names": names, "values": values}
    if kind == "repeat":
        sc["names"] = [*names, names[0]]
        sc["values"] = [*values, draw(_values)]
    elif kind == "count":
        sc["values"] = [*values, 0] if draw(st.booleans()) or len(values) == 1 else values[1:]
    elif kind == "scheme":
        sc["scheme"] = draw(json_value)
    elif kind == "value":
        sc[draw(st.sampled_from(["names", "values"]))] = draw(
            json_value | st.lists(st.integers(-(2**70), 2**70) | st.floats() | st.booleans()
                                  | st.text(max_size=3), min_size=1, max_size=3))
    elif kind == "empty":
        sc["names"], sc["values"] = [], []
    elif kind == "extra":
        sc[draw(_names)] = draw(json_value)
    return sc


_TRANSFER_KEYS = ["completed", "mutation_started", "backend", "tensors", "bytes",
                  "finish_label", "error", "elapsed_s", "unverified", "sent_checksum", "extra"]


@st.composite
def report_bodies(draw: st.DrawFn) -> Body:
    kind = draw(st.sampled_from(["transfer", "transfer", "checksum", "checksum", "failure",
                                 "top", "json", "hostile", "hostile"]))
    if kind == "transfer":  # one field of a good report replaced by any JSON
        key = draw(st.sampled_from(_TRANSFER_KEYS))
        obj: Any = {"transfer": {**EV, key: draw(json_value)}}
    elif kind == "checksum":
        obj = {"transfer": {**EV, "sent_checksum": draw(sent_checksums())}}
    elif kind == "failure":
        key = draw(st.sampled_from(["kind", "reason", "extra"]))
        obj = {"failure": {"kind": "error", "reason": "x", key: draw(json_value)}}
    elif kind == "top":
        obj = draw(st.sampled_from([
            {}, {"transfer": EV, "failure": {"kind": "refused", "reason": "x"}},
            {"transfer": None}, {"failure": None}, {"transfer": EV, "extra": 1},
            {"transfer": [EV]}, {"Transfer": EV}]))
    elif kind == "json":
        obj = draw(json_value)
    else:
        raw = draw(st.sampled_from(_HOSTILE_REPORTS))
        return Body(f"hostile {raw[:60]!r}", raw, draw(_CTYPES))
    return Body(f"{kind} {obj!r}"[:300], _js(obj), draw(_CTYPES))


_EVB = _js(EV)[:-1]  # the evidence's object, open for one more field
#: Nested deeper than the parser's recursion limit, within the size limit.
DEEP = b'{"transfer": ' + _EVB + b', "error": ' + _deep(30_000) + b"}}"
OVERSIZE = b'{"transfer": ' + _EVB + b', "error": "' + b"e" * (MAX_BODY + 1) + b'"}}'
NAN = b'{"transfer": ' + _EVB + b', "elapsed_s": NaN}}'
#: Repeated keys: JSON's parsers keep the last one (here a good report).
DUPLICATE = b'{"transfer": ' + _js({**EV, "tensors": "4"}) + b', "transfer": ' + _js(EV) + b"}"
_HOSTILE_REPORTS: list[bytes] = [
    DEEP, OVERSIZE, NAN, DUPLICATE,
    b'{"transfer": ' + _EVB + b', "error": ' + _deep(70) + b"}}",
    b'{"transfer": ' + _EVB + b', "error": ' + b'{"a":' * 2000 + b"1" + b"}" * 2000 + b"}}",
    b'{"transfer": ' + _EVB + b', "elapsed_s": -Infinity}}',
    b'{"transfer": ' + _EVB + b', "elapsed_s": 1e400}}',
    b'{"transfer": ' + _EVB + b', "tensors": ' + b"9" * 4000 + b"}}",
    b'{"transfer": ' + _EVB + b', "tensors": ' + b"9" * 5000 + b"}}",
    b'{"transfer": ' + _EVB + b', "backend": "\xff\xfe"}}',
    b'{"transfer": ' + _EVB + b', "error": "\\ud800"}}',
    b'{"failure": {"kind": "refused", "reason": "\\udfff"}}',
    b'{"transfer": ' + _EVB + b', "unverified": [' + b'"u",' * 20_000 + b'"u"]}}',
    b"\xef\xbb\xbf" + _js({"transfer": EV}),
    _js({"transfer": EV}).decode().encode("utf-16"),
    b'{"transfer": ' + _js(EV) + b', "transfer": ' + _js({**EV, "tensors": "4"}) + b"}",
    b'{"failure": {"kind": "refused", "reason": "x"}, "failure": {"kind": "nope"}}',
    b'{"transfer": ' + _js(EV) + b', "transfer": null}',
    b'{"transfer": {"completed": true, "completed": false, "mutation_started": true, '
    b'"backend": "fake", "tensors": 4}}',
    b"", b"{", b"[]", b"null", b"0", b'"transfer"', b"\x00\x01\x02", b"{}" * 3,
]


@st.composite
def aims(draw: st.DrawFn) -> tuple[str, str]:
    """(the update id, the lease secret) a report presents: mostly the live update's own."""
    uid = draw(st.sampled_from(["own"] * 6 + ["random", "stale", "zero", "negative", "huge",
                                              "text", "unicode-digit", "leading-zeros"]))
    lease = draw(st.sampled_from(["own"] * 6 + ["forged", "missing", "empty", "stale",
                                                "long", "latin-1", "padded"]))
    return uid, lease


def _aim(p: Proto, g: Grant, aim: tuple[str, str]) -> tuple[str, dict[str, Any]]:
    uid, lease = aim
    stale = p.last_final
    path_id = {"own": str(g.uid), "random": str(g.uid ^ 0x5A5A5A5A),
               "stale": str(stale.uid if stale else 12345), "zero": "0", "negative": "-1",
               "huge": "9" * 30, "text": "abc", "unicode-digit": "\u00b2",
               "leading-zeros": "0" * 3 + str(g.uid)}[uid]
    secret: Any = {"own": g.secret, "forged": "x" * len(g.secret), "missing": None, "empty": "",
                   "stale": stale.secret if stale else "s", "long": g.secret * 20,
                   "latin-1": (g.secret[:-1] + "\u00e9").encode("latin-1"),
                   "padded": g.secret + "=="}[lease]
    headers = {} if secret is None else {LEASE_HEADER: secret}
    return f"/control/updates/{path_id}/transfer", headers


@st.composite
def begin_bodies(draw: st.DrawFn) -> Body:
    base = begin_body(FOREIGN)
    kind = draw(st.sampled_from(["top", "top", "nested", "nested", "probe", "json",
                                 "hostile", "valid"]))
    if kind == "top":
        key = draw(st.sampled_from(["identity", "owner", "label", "min_verification", "expect",
                                    "lease_s", "source_manifest_digest", "begin_key", "extra"]))
        obj: Any = {**base, key: draw(json_value | st.sampled_from(_BEGIN_VALUES))}
    elif kind == "nested":
        part = draw(st.sampled_from(["identity", "provenance", "expect"]))
        key = draw(st.sampled_from({
            "identity": ["manifest_digest", "content_digest", "provenance", "extra"],
            "provenance": ["checkpoint", "trainer_run", "step", "extra"],
            "expect": ["probe", "engine_checksums", "transport_checksum", "extra"]}[part]))
        v = draw(json_value | st.sampled_from(_BEGIN_VALUES))
        if part == "provenance":
            obj = {**base, "identity": {**base["identity"], "provenance": {
                **base["identity"]["provenance"], key: v}}}
        else:
            obj = {**base, part: {**base[part], key: v}}
    elif kind == "probe":
        probe = base["expect"]["probe"]
        case = probe["cases"][0]
        key = draw(st.sampled_from(["prompt", "continuation", "logprobs", "tolerance", "name",
                                    "cases", "extra"]))
        v = draw(json_value | st.sampled_from([
            [], [-1], [2**31], [10**6], [0.5], [float("-inf")], [1e-9] * len(case["logprobs"]),
            case["logprobs"][:-1], 11.0, 1e-300, 0, "x" * 300, [case] * 200]))
        if key in ("tolerance", "name", "cases", "extra"):
            probe = {**probe, key: v}
        else:
            probe = {**probe, "cases": [{**case, key: v}, *probe["cases"][1:]]}
        obj = {**base, "expect": {**base["expect"], "probe": probe}}
    elif kind == "json":
        obj = draw(json_value)
    elif kind == "hostile":
        raw = draw(st.sampled_from(_HOSTILE_BEGINS))
        return Body(f"hostile {raw[:60]!r}", raw, draw(_CTYPES))
    else:
        obj = {**base, **draw(st.fixed_dictionaries({}, optional={
            "label": st.sampled_from(["step-x", "rc-0", "a" * 128]),
            "lease_s": st.sampled_from([1e-9, 0.5, 1800.0, 86400.0]),
            "min_verification": st.sampled_from(["declared", "manifest", "engine-checksum",
                                                 "probe"]),
            "begin_key": st.just("k" * 16), "owner": st.sampled_from(["o", "\u00e9" * 128])}))}
    return Body(f"{kind} {json.dumps(obj)[:300]}", _js(obj), draw(_CTYPES))


_BEGIN_VALUES: list[Any] = [
    "b" * 64, "A" * 64, "a" * 63, "rc-0", "bad label", "", "x" * 129, 0, -1, 1e-9, 86401,
    2**63, "declared", "probe", "engine-checksum", "none", True, None, [], {}, {"x": 1},
    "k" * 15, "k" * 129, "\u00b2" * 16]
_HOSTILE_BEGINS: list[bytes] = [
    _js(begin_body(FOREIGN))[:-1] + b', "extra": ' + _deep(30_000) + b"}",
    _js(begin_body(FOREIGN))[:-1] + b', "lease_s": NaN}',
    _js(begin_body(FOREIGN))[:-1] + b', "lease_s": 1e400}',
    _js(begin_body(FOREIGN))[:-1] + b', "owner": "\xff"}',
    _js(begin_body(FOREIGN))[:-1] + b', "owner": "a", "owner": 1}',
    _js(begin_body(FOREIGN))[:-1] + b', "pad": "' + b"p" * MAX_BODY + b'"}',
    _js(begin_body(FOREIGN))[:-1] + b', "expect": {"engine_checksums": {' + b",".join(
        b'"p%d": "%s"' % (i, b"a" * 64) for i in range(700)) + b"}}}",
    b"", b"[]", b"null", b"{", b"\xef\xbb\xbf{}",
]


# ------------------------------------------------------------------------------- tests

def test_fuzzed_reports_against_a_live_lease(fresh: Proto) -> None:
    """A report body, aimed at a live update whose weights were sent: refused (4xx, with a
    reason, nothing changed, the lease still usable: the real report then publishes) or
    decided; and after it, a new update begins, reports and publishes."""
    p = fresh

    @_settings(12)
    @given(body=report_bodies(), aim=aims())
    @example(body=Body("repeated names", _js({"transfer": {**EV, "sent_checksum": {
        "scheme": "rc_cuda_ipc/block", "names": ["a", "a"], "values": [1, 2]}}})),
             aim=("own", "own"))
    @example(body=Body("values not one per name", _js({"transfer": {**EV, "sent_checksum": {
        "scheme": "rc_cuda_ipc/block", "names": ["a", "b"], "values": [1]}}})),
             aim=("own", "own"))
    @example(body=Body("text/plain", _js({"transfer": EV}), "text/plain"), aim=("own", "own"))
    @example(body=Body("oversize", OVERSIZE), aim=("own", "own"))
    @example(body=Body("nested 30000 deep", DEEP), aim=("own", "own"))
    @example(body=Body("NaN", NAN), aim=("own", "own"))
    @example(body=Body("duplicate keys, the last one good", DUPLICATE), aim=("own", "own"))
    @example(body=Body("a good report, a forged lease", _js({"transfer": EV})),
             aim=("own", "forged"))
    @example(body=Body("a good report, a stale update", _js({"transfer": EV})),
             aim=("stale", "stale"))
    @example(body=Body("a good report, another update's lease", _js({"transfer": EV})),
             aim=("own", "stale"))
    def one(body: Body, aim: tuple[str, str]) -> None:
        g = p.begin(p.weights())
        p.transfer(g)
        path, headers = _aim(p, g, aim)
        before = p.state()
        resp = p.call("POST", path, content=body.raw, headers={**headers, **body.headers()})
        if resp.status_code == 200:
            assert aim[0] in ("own", "leading-zeros") and aim[1] == "own", (body, aim)
            p.decided(resp, g)
        else:
            p.refused(resp, before, f"{body.what} {aim}")
            p.publish(g)
        p.alive()

    one()


def test_fuzzed_begins(fresh: Proto) -> None:
    """A begin body, with or without another update open: refused (4xx, a reason, nothing
    changed: the open update still publishes) or granted (then ended by its trainer); and
    after it, a new update begins, reports and publishes."""
    p = fresh

    @_settings(10)
    @given(body=begin_bodies(), busy=st.booleans())
    @example(body=Body("a source that is not the target", _js({
        **begin_body(FOREIGN), "source_manifest_digest": "b" * 64})), busy=False)
    @example(body=Body("a good begin while another is open", _js(begin_body(FOREIGN))),
             busy=True)
    @example(body=Body("a good begin as text", _js(begin_body(FOREIGN)), "text/plain"),
             busy=False)
    @example(body=Body("a lease of 1 ns", _js({**begin_body(FOREIGN), "lease_s": 1e-9})),
             busy=False)
    def one(body: Body, busy: bool) -> None:
        held = p.begin(p.weights()) if busy else None
        before = p.state()
        resp = p.call("POST", "/control/updates", content=body.raw, headers=body.headers())
        if resp.status_code == 201:
            assert held is None, resp.text
            p.granted(resp.json(), None)
        else:
            p.refused(resp, before, body.what)
        if held is not None:
            p.publish(held)
        p.alive()

    one()


# The out-of-order calls: each step's answer is checked against what the protocol says.
STEPS = ["begin", "begin", "transfer", "transfer", "report", "report", "refuse", "fail",
         "retry", "other", "forged", "stale", "unknown", "expire", "get", "status"]


@_settings(8)
@given(steps=st.lists(st.sampled_from(STEPS), max_size=8))
@example(steps=["report"])                                     # report before begin
@example(steps=["begin", "transfer", "report", "report"])      # publish twice
@example(steps=["begin", "report", "refuse"])                  # report of nothing sent
@example(steps=["begin", "transfer", "expire", "report"])      # report after expiry (sent)
@example(steps=["begin", "expire", "report", "refuse"])        # report after expiry (nothing)
@example(steps=["begin", "begin", "retry", "other", "forged", "stale", "transfer", "report"])
@example(steps=["other", "other", "retry", "transfer", "report"])
@example(steps=["begin", "transfer", "refuse"])                # refused, but it was sent
def test_protocol_calls_in_any_order(proto: Proto, steps: list[str]) -> None:
    p = proto
    serve_fake(p.fake)
    p.settle()
    cur: Grant | None = None   # the open update, if any
    expired = False
    for step in steps:
        before = p.state()
        if step == "begin":
            w = p.weights()
            resp = p.call("POST", "/control/updates",
                          json_body=begin_body(w, begin_key=_key(w)))
            if cur is None:
                assert resp.status_code == 201, resp.text
                cur, expired = p.granted(resp.json(), w), False
            else:
                p.refused(resp, before, step)
                assert resp.status_code == 409
        elif step == "transfer":
            if cur is not None and not cur.transferred:
                p.transfer(cur)
        elif step in ("report", "refuse", "fail"):
            g = cur or p.last_final
            if g is None:  # before any begin: no such update
                resp = p.call("POST", "/control/updates/77/transfer", json_body={"transfer": EV},
                              headers={LEASE_HEADER: "s" * 43})
                p.refused(resp, before, step)
                assert resp.status_code == 404
                continue
            body = {"transfer": {**EV, "finish_label": g.label}} if step == "report" else {
                "failure": {"kind": "refused" if step == "refuse" else "error", "reason": step}}
            resp = p.report(g, body)
            if cur is None:  # its update is decided already (or forgotten)
                p.refused(resp, before, step)
                assert resp.status_code in (404, 409, 410), resp.text
                continue
            if expired:
                assert resp.status_code == 410, resp.text
                d = resp.json()
                assert d["final"] and d["status"] == "expired", d
                want = "ambiguous" if cur.transferred else "no_mutation"
                assert d["result"]["classification"] == want, d
                p.last_final = cur
            else:
                assert resp.status_code == 200, resp.text
                d = p.decided(resp, cur)
                status = d["status"]
                res = d["result"]
                if step == "report":  # evidence of a transfer: true only if it happened
                    assert status == ("published" if cur.transferred else "failed"), d
                elif step == "refuse":  # provably nothing sent, or the engine says otherwise
                    want = "ambiguous" if cur.transferred else "no_mutation"
                    assert res["classification"] == want, d
                else:
                    assert res["classification"] == "ambiguous", d
            cur = None
            p.settle()  # recovers a TAINTED gateway (the next begin needs READY)
        elif step == "retry":  # the same begin again: the same grant
            if cur is None:
                continue
            assert cur.weights is not None
            resp = p.call("POST", "/control/updates", json_body=begin_body(
                cur.weights, owner=cur.body["owner"], begin_key=_key(cur.weights)))
            # (also past a moved deadline: the lease is open until something expires it)
            assert resp.status_code == 200, resp.text
            assert resp.json()["update_id"] == cur.uid
            assert resp.json()["lease"]["secret"] == cur.secret
            assert p.state() == before
        elif step == "other":  # another trainer, the same key
            w = cur.weights if cur is not None and cur.weights is not None else p.weights()
            owner = "trainer" if cur is not None and cur.body["owner"] != "trainer" \
                else "intruder"
            resp = p.call("POST", "/control/updates", json_body=begin_body(
                w, owner=owner, begin_key=_key(w)))
            if cur is None:
                assert resp.status_code == 201, resp.text
                cur, expired = p.granted(resp.json(), w), False
            else:
                p.refused(resp, before, step)
        elif step in ("forged", "stale", "unknown"):
            g = cur or p.last_final
            if g is None:
                continue
            stale = p.last_final
            uid = {"forged": g.uid, "stale": stale.uid if stale else 1,
                   "unknown": g.uid ^ 0x3C3C3C}[step]
            secret = {"forged": "f" * 43, "stale": stale.secret if stale else "s",
                      "unknown": g.secret}[step]
            resp = p.call("POST", f"/control/updates/{uid}/transfer",
                          json_body={"transfer": EV}, headers={LEASE_HEADER: secret})
            p.refused(resp, before, step)
        elif step == "expire":  # the lease's deadline passes before any report
            if cur is not None:
                p.gw.updates._updates[cur.uid].deadline_mono = time.monotonic() - 1.0
                expired = True
        elif step == "get":
            g = cur or p.last_final
            if g is None:
                continue
            resp = p.call("GET", f"/control/updates/{g.uid}", headers={LEASE_HEADER: g.secret})
            if resp.status_code == 404:  # a decided update the gateway no longer keeps
                assert cur is None
                continue
            assert resp.status_code == 200 and resp.json()["final"] == (cur is None), resp.text
            assert p.state() == before
        elif step == "status":
            st_ = p.call("GET", "/control/status").json()
            assert (st_["update"] is None) == (cur is None), st_
            assert p.state() == before
    p.alive()


def test_a_report_after_the_lease_ran_out_is_410_and_changes_nothing(fresh: Proto) -> None:
    """Nothing sent, the lease's own timer ends it (no_mutation, back in service); weights
    sent, its deadline passes (moved: a transfer racing a short timer would be flaky) and
    the first report classifies it (ambiguous, TAINTED). A report after either is a 410
    that changes nothing."""
    p = fresh
    for send in (False, True):
        g = p.begin(p.weights(), lease_s=1800 if send else 0.05)
        if send:
            p.transfer(g)
            p.gw.updates._updates[g.uid].deadline_mono = time.monotonic() - 1.0
            first = p.report(g, {"transfer": {**EV, "finish_label": g.label}})
            assert first.status_code == 410, first.text
        deadline = time.monotonic() + 15
        while not (info := p.call("GET", f"/control/updates/{g.uid}",
                                  headers={LEASE_HEADER: g.secret}).json())["final"]:
            assert time.monotonic() < deadline, info
            time.sleep(0.01)
        assert info["status"] == "expired"
        assert info["result"]["classification"] == ("ambiguous" if send else "no_mutation")
        assert p.gw.controller.state is (State.TAINTED if send else State.READY)
        before = p.state()
        late = p.report(g, {"transfer": {**EV, "finish_label": g.label}})
        p.refused(late, before, "late report")
        assert late.status_code == 410
        p.last_final = g
        p.alive()


# --------------------------------------------------------------- schemathesis

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.parameters import ParameterLocation  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from rolloutcore.service.control_openapi import openapi_document  # noqa: E402


def _schema(*, coverage: bool) -> Any:
    s = schemathesis.openapi.from_dict(openapi_document())
    s.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    # The coverage phase (every boundary and type of every field, not bounded by
    # max_examples: about 600 cases here, each followed by an update) runs on demand.
    s.config.phases.coverage.enabled = coverage
    return s


schema = _schema(coverage=os.environ.get("ROLLOUTCORE_FUZZ_COVERAGE") == "1")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]
_SCOPED = ("/control/updates/{update_id}", "/control/updates/{update_id}/transfer")


def _one_case(case: Any, p: Proto) -> None:
    serve_fake(p.fake)
    p.settle()
    live: Grant | None = None
    if case.operation.path in _SCOPED:
        # Aimed at a live update whose weights were sent, unless the case is negative
        # there (or one case in four: the generated id, or lease, stays: forged).
        live = p.begin(p.weights())
        p.transfer(live)
        pick = zlib.crc32(repr(case).encode()) % 4
        meta = case.meta
        if pick != 1 and not (meta and meta.is_negative_at(ParameterLocation.PATH)):
            case.path_parameters = {**(case.path_parameters or {}), "update_id": live.uid}
        if pick != 2 and not (meta and meta.is_negative_at(ParameterLocation.HEADER)):
            case.headers = {**(case.headers or {}), LEASE_HEADER: live.secret}
    before = p.state()
    resp = case.call(base_url=p.url, headers=dict(AUTH), timeout=30)
    case.validate_response(resp, checks=CHECKS)
    method = case.operation.method.upper()
    route = case.operation.path.replace("{update_id}", "{id}")
    p.statuses[(f"{method} {route}", resp.status_code)] += 1
    if resp.status_code >= 400:
        err = resp.json().get("error")
        assert isinstance(err, str) and err.strip(), resp.text
        assert p.state() == before, (case, resp.status_code, resp.text[:300])
    elif method == "POST" and case.operation.path == "/control/updates":
        if resp.status_code == 201:
            p.granted(resp.json(), None)
    elif method == "POST" and live is not None:
        assert resp.status_code == 200
        p.decided(resp, live)
    elif method == "GET":
        assert p.state() == before
    upd = p.gw.updates.open_update
    if live is not None and upd is not None and upd.update_id == live.uid:
        p.publish(live)  # whatever was refused, the live lease still publishes
    p.alive()


@schema.parametrize()
@_settings(6)
def test_control_api_from_its_schema_then_an_update_publishes(case: Any, proto: Proto) -> None:
    _one_case(case, proto)


def test_zz_the_fuzzing_reached_every_outcome(proto: Proto) -> None:
    """The fuzzers got past the edge: grants, publications, refusals of each kind."""
    seen = set(proto.statuses)
    if not any(r.endswith("/transfer") for r, _ in seen):
        pytest.skip("the fuzz tests did not run in this session")
    codes = Counter(s for (_, s) in seen)
    for want in (200, 201, 400, 403, 404, 409, 410, 413, 415, 422):
        assert codes[want], (want, sorted(seen))
    assert not any(s >= 500 for _, s in seen)
