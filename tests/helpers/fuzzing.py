"""The gateway fuzz harness: a gateway over the fake vLLM on real loopback HTTP, and inputs.

Used by ``tests/test_gateway_fuzz.py`` (a fast run and a slow one) and, via
that file, by ``benchmarks/fuzz.py`` (``results/fuzz.json``). Three kinds of
input: hypothesis bodies for the three data routes (plausible fields with
hostile values, random JSON, random bytes, random headers), hand-written
hostile bodies (deep nesting, huge numbers, NaN, wrong types, invalid UTF-8,
oversize) for the data and the control routes, and (in the schemathesis
test) the control API's own OpenAPI document.

A ``Tally`` counts what came back: every status, the server errors (5xx),
the hangs (no answer within the client's timeout) and the requests after
which the gateway was no longer idle and READY.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hypothesis import strategies as st

from helpers.gateway_rig import AUTH, TOKEN, make_parts, serve_fake, uvicorn_thread
from rolloutcore.core.lifecycle import State
from rolloutcore.service import ServiceConfig, create_app
from rolloutcore.service.proxy import DATA_ROUTES
from rolloutcore.testing.fake_vllm import FakeVllm

__all__ = ["HOSTILE", "Tally", "fuzz_gateway", "request_strategy", "write_section"]

MAX_BODY = 64 << 10
TIMEOUT_S = 10.0


@dataclass
class Tally:
    name: str
    examples: int = 0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    not_idle: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict[str, Any]:
        return {"examples": self.examples, "statuses": {str(k): v for k, v in
                                                        sorted(self.statuses.items())},
                "server_errors": len(self.server_errors), "hangs": len(self.hangs),
                "not_idle_after": len(self.not_idle),
                "first_server_errors": self.server_errors[:5], "first_hangs": self.hangs[:5],
                "seconds": round(time.monotonic() - self.started, 2)}


@dataclass
class FuzzGateway:
    url: str
    gateway: Any
    fake: FakeVllm
    client: httpx.Client

    def send(self, tally: Tally, method: str, path: str, content: bytes,
             headers: dict[str, str], what: str) -> httpx.Response | None:
        tally.examples += 1
        try:
            resp = self.client.request(method, path, content=content, headers=headers)
        except httpx.TimeoutException:
            tally.hangs.append(what[:300])
            return None
        except httpx.TransportError as exc:  # a dropped connection: the server broke
            tally.server_errors.append(f"{what[:300]} -> {exc!r}")
            return None
        self._seen(tally, resp.status_code, resp.text, what)
        return resp

    def raw(self, tally: Tally, method: str, path: str, content: bytes,
            headers: dict[str, str], what: str) -> tuple[int, bytes] | None:
        """Exactly these bytes on a socket (no client fixes a bad length or header)."""
        tally.examples += 1
        host, port = self.url.rsplit("/", 1)[-1].split(":")
        hdrs = {"host": host, "connection": "close", "content-length": str(len(content)),
                **headers}
        head = f"{method} {path} HTTP/1.1\r\n".encode() + b"".join(
            k.encode() + b": " + v.encode("latin-1") + b"\r\n" for k, v in hdrs.items())
        data = b""
        try:
            with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as c:
                c.sendall(head + b"\r\n" + content)
                with contextlib.suppress(ConnectionResetError):
                    while chunk := c.recv(65536):
                        data += chunk
        except TimeoutError:
            tally.hangs.append(what[:300])
            return None
        if not data.startswith(b"HTTP/1.1 "):
            tally.server_errors.append(f"{what[:300]} -> no HTTP answer: {data[:100]!r}")
            return None
        status = int(data[9:12])
        self._seen(tally, status, data.split(b"\r\n\r\n", 1)[-1][:200].decode("latin-1"),
                   what)
        return status, data

    def _seen(self, tally: Tally, status: int, text: str, what: str) -> None:
        tally.statuses[status] += 1
        if status >= 500:
            tally.server_errors.append(f"{what[:300]} -> {status} {text[:200]}")
        c = self.gateway.controller
        deadline = time.monotonic() + 2.0
        while (c.active or c.state is not State.READY) and time.monotonic() < deadline:
            time.sleep(0.002)  # a release can trail the last byte by a moment
        if c.active or c.state is not State.READY:
            tally.not_idle.append(what[:300])


@contextlib.contextmanager
def fuzz_gateway() -> Iterator[FuzzGateway]:
    """A gateway (real uvicorn, loopback) over the fake vLLM, with small bounds."""
    eng, ad, c, r, j, fake = make_parts(token_delay_s=0.0)
    up = serve_fake(fake)
    app = create_app(r, ServiceConfig(upstream_url=up, control_token=TOKEN, lease_s=1800,
                                      max_body_bytes=MAX_BODY, health_interval_s=0,
                                      client_body_s=5.0, client_send_s=5.0))
    with uvicorn_thread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        yield FuzzGateway(url, app.state.gateway, fake, client)


# --------------------------------------------------------------------------- strategies

_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
         | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_value = st.recursive(_leaf, lambda c: st.lists(c, max_size=4)
                          | st.dictionaries(st.text(max_size=8), c, max_size=4),
                          max_leaves=16)
_ids = st.lists(st.integers(0, 200), min_size=1, max_size=6) | st.lists(
    st.integers(-3, 300), max_size=6) | json_value
_sampling = st.fixed_dictionaries({"max_tokens": st.integers(1, 8)}) | st.fixed_dictionaries(
    {}, optional={
    "max_tokens": st.integers(-2, 12) | json_value, "temperature": st.floats(-1, 3) | json_value,
    "top_p": st.floats(-0.5, 1.5) | json_value, "top_k": st.integers(-3, 50) | json_value,
    "n": st.integers(-1, 3) | json_value, "seed": st.integers(-(2**65), 2**65) | json_value,
    "logprobs": st.integers(-1, 5) | json_value, "extra": json_value}) | json_value
_stream = st.booleans() | json_value
_bodies = {
    "/inference/v1/generate": st.fixed_dictionaries({}, optional={
        "token_ids": _ids, "sampling_params": _sampling, "stream": _stream,
        "request_id": json_value, "rolloutcore": json_value}),
    "/v1/completions": st.fixed_dictionaries({}, optional={
        "model": json_value, "prompt": st.text(max_size=20) | _ids | json_value,
        "max_tokens": st.integers(-2, 12) | json_value, "stream": _stream}),
    "/v1/chat/completions": st.fixed_dictionaries({}, optional={
        "model": json_value, "max_tokens": st.integers(-2, 12) | json_value,
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(
            ["user", "system", "assistant"]) | json_value, "content": st.text(max_size=20)
            | json_value}), max_size=3) | json_value, "stream": _stream}),
}
_ascii = st.characters(min_codepoint=0x20, max_codepoint=0x7E)


@st.composite
def request_strategy(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str], str]:
    """(route, raw body, headers, description) for one data-plane request."""
    route = draw(st.sampled_from(DATA_ROUTES))
    kind = draw(st.sampled_from(["fields", "fields", "fields", "json", "bytes"]))
    if kind == "fields":
        raw = json.dumps(draw(_bodies[route])).encode()
    elif kind == "json":
        raw = json.dumps(draw(json_value)).encode()
    else:
        raw = draw(st.binary(max_size=200))
    headers = {"content-type": draw(st.sampled_from(
        ["application/json"] * 6 + ["application/json; charset=utf-8", "text/plain",
                                    "APPLICATION/JSON", "application/jsonx"]))}
    # (httpx refuses header values with outer whitespace: that is the client's rule)
    rid = draw(st.none() | st.none() | st.text(_ascii, max_size=140).map(str.strip))
    if rid is not None:
        headers["x-rolloutcore-rollout-id"] = rid
    for h in draw(st.lists(st.sampled_from(["x-rolloutcore-run", "x-rolloutcore-step",
                                            "x-rolloutcore-prompt-index"]), max_size=3)):
        headers[h] = draw(st.text(_ascii, max_size=20).map(str.strip))
    return route, raw, headers, f"{route} {headers} {raw[:200]!r}"


# --------------------------------------------------------------------------- hostile bodies

def _deep(n: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * n + close * n


_BEGIN_PREFIX = b'{"identity": {"manifest_digest": "' + b"a" * 64 + b'", "provenance": '

#: (method, path, raw body, extra headers, what) - every one must be answered < 500.
HOSTILE: list[tuple[str, str, bytes, dict[str, str], str]] = [
    *[("POST", route, body, {}, what) for route in DATA_ROUTES for body, what in (
        (b'{"token_ids": [1], "sampling_params": {"x": ' + _deep(200_00) + b"}}",
         "nesting 20000 deep"),
        (b'{"x": ' + _deep(65, b'{"a":', b"}") + b"}", "object nesting 65 deep"),
        (b'{"token_ids": [1], "sampling_params": {"temperature": NaN}}', "NaN"),
        (b'{"token_ids": [1], "sampling_params": {"temperature": -Infinity}}', "-Infinity"),
        (b'{"token_ids": [1], "sampling_params": {"temperature": 1e400}}', "1e400"),
        (b'{"token_ids": [' + b"9" * 4000 + b"]}", "an int of 4000 digits"),
        (b'{"token_ids": [' + b"9" * 5000 + b"]}", "an int past Python's digit limit"),
        (b'{"token_ids": "1 2 3", "sampling_params": [], "stream": "yes"}', "wrong types"),
        (b'{"token_ids": [1], "stream": 1}', "stream as a number"),
        (b'{"token_ids": [1], "prompt": "\xff\xfe\xfd"}', "invalid UTF-8"),
        (b'{"token_ids": [1], "prompt": "\\ud800"}', "a lone surrogate escape"),
        (b"\xef\xbb\xbf{}", "a UTF-8 BOM"),
        (b'{"a": 1, "a": 2}', "duplicate keys"),
        (b"[]", "an array"), (b"null", "null"), (b"", "empty"), (b"{", "truncated"),
        (b'{"rolloutcore": {}}', "the reserved field"),
        (b'{"x": "' + b"a" * (MAX_BODY + 1) + b'"}', "oversize"),
    )],
    ("POST", "/inference/v1/generate", b"{}", {"content-length": "99999999999999999999"},
     "a huge content-length"),
    ("POST", "/inference/v1/generate", b"{}", {"content-length": "-1"}, "a negative length"),
    ("POST", "/inference/v1/generate", b'{"token_ids": [1]}',
     {"x-rolloutcore-rollout-id": "a" * 5000}, "a 5000-byte rollout id"),
    ("POST", "/inference/v1/generate", b'{"token_ids": [1]}',
     {"authorization": "Bearer " + "x" * 10_000}, "a huge bearer token"),
    ("GET", "/inference/v1/generate", b"", {}, "GET on a data route"),
    *[("POST", path, body, {**AUTH}, what) for path in
      ("/control/updates", "/control/updates/1/transfer") for body, what in (
        (b'{"identity": ' + _deep(100_000) + b"}", "nesting 100000 deep"),
        (_BEGIN_PREFIX + _deep(2000, b'{"a":', b"}") + b"}}", "object nesting 2000 deep"),
        (b'{"owner": "x", "lease_s": NaN}', "NaN lease"),
        (b'{"owner": "x", "lease_s": 1e400}', "1e400 lease"),
        (b'{"transfer": {"completed": true, "mutation_started": true, "backend": "x", '
         b'"tensors": ' + b"9" * 4000 + b"}}", "a 4000-digit tensor count"),
        (b'{"owner": "\xff"}', "invalid UTF-8"),
        (b'{"x": "' + b"a" * (MAX_BODY + 1) + b'"}', "oversize"),
        (b"[]", "an array"), (b"", "empty"),
    )],
    ("GET", "/control/updates/99999999999999999999999999", b"", {**AUTH}, "a huge update id"),
    ("GET", "/control/updates/-1", b"", {**AUTH}, "a negative update id"),
]


def write_section(name: str, tally: Tally) -> None:
    """With ROLLOUTCORE_FUZZ_JSON=path, merge this run's tally into that JSON file."""
    out = os.environ.get("ROLLOUTCORE_FUZZ_JSON")
    if not out:
        return
    p = Path(out)
    data = json.loads(p.read_text()) if p.exists() else {}
    data[name] = tally.to_dict()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
