"""Fuzzing the gateway's data and control APIs (#16): no 500, no hang, nothing left bound.

Over real loopback HTTP (uvicorn) to a gateway over the fake vLLM
(``helpers.fuzzing``): hypothesis-generated data-plane requests (plausible
fields with hostile values, random JSON, random bytes and headers) and a
hand-written list of hostile bodies (deep nesting, huge numbers, NaN, wrong
types, invalid UTF-8, oversize) for the data and control routes. The
control API's schema-driven fuzzing is ``test_service_schemathesis.py``.

The fast lane runs a small sample (a few seconds); the slow-marked test runs
thousands of examples, and with ``ROLLOUTCORE_FUZZ_JSON=path`` both write
their counts there (``benchmarks/fuzz.py`` writes ``results/fuzz.json``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings

from helpers.fuzzing import (
    HOSTILE,
    FuzzGateway,
    Tally,
    fuzz_gateway,
    request_strategy,
    write_section,
)

SLOW_EXAMPLES = int(os.environ.get("ROLLOUTCORE_FUZZ_EXAMPLES", "3000"))


@pytest.fixture(scope="module")
def gw() -> Iterator[FuzzGateway]:
    with fuzz_gateway() as g:
        yield g


_JSON = {"content-type": "application/json"}
#: Requests that must succeed, so that every run reaches past validation.
_VALID = [("/inference/v1/generate",
           b'{"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}', _JSON, "valid"),
          ("/v1/completions", b'{"prompt": "hi", "max_tokens": 3, "stream": true}', _JSON,
           "valid stream")]


def _run(gw: FuzzGateway, tally: Tally, examples: int, derandomize: bool) -> None:
    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck))
    @given(request_strategy())
    def one(req: tuple[str, bytes, dict[str, str], str]) -> None:
        route, raw, headers, what = req
        gw.send(tally, "POST", route, raw, headers, what)

    for req in _VALID:
        one = example(req)(one)
    one()


def _check(tally: Tally) -> None:
    assert tally.server_errors == [], tally.server_errors[:5]
    assert tally.hangs == [], tally.hangs[:5]
    assert tally.not_idle == [], tally.not_idle[:5]


def test_hostile_bodies_are_answered_below_500(gw: FuzzGateway) -> None:
    tally = Tally("hostile")
    for method, path, raw, headers, what in HOSTILE:
        h = {"content-type": "application/json", **headers}
        got = gw.raw(tally, method, path, raw, h, what)
        # Every error is the gateway's JSON, except uvicorn's own 400 for a request
        # line or headers it cannot parse (a length that is no number).
        if got is not None and got[0] >= 400 and b"Invalid HTTP request" not in got[1]:
            assert b"application/json" in got[1].split(b"\r\n\r\n")[0], (what, got[1][:300])
    write_section("hostile_bodies", tally)
    _check(tally)
    assert tally.examples == len(HOSTILE) and set(tally.statuses) <= {200, 400, 405, 408, 413, 422,
                                                                      401, 403, 404, 415}


def test_fuzzed_data_requests_never_500_nor_hang(gw: FuzzGateway) -> None:
    tally = Tally("data_plane")
    _run(gw, tally, 60, derandomize=True)
    write_section("data_plane_fast", tally)
    _check(tally)
    assert tally.statuses[200] > 0 and tally.statuses[400] > 0  # reached past validation


@pytest.mark.slow
def test_fuzzed_data_requests_long_run(gw: FuzzGateway) -> None:
    tally = Tally("data_plane")
    _run(gw, tally, SLOW_EXAMPLES, derandomize=False)
    write_section("data_plane", tally)
    _check(tally)
