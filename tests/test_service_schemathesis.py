"""Property-based fuzzing of the control API from its own OpenAPI document (schemathesis).

Positive and negative cases for every control operation, sent over real
loopback HTTP to a gateway over the FakeEngine. Checks: never a server
error, only documented status codes and content types, responses of the
documented shape, invalid data rejected with 4xx, and (our own check) a
rejected request changed nothing.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from helpers.gateway_rig import AUTH, TOKEN, make_parts, uvicorn_thread  # noqa: E402
from rolloutcore.service import ServiceConfig, create_app  # noqa: E402
from rolloutcore.service.control_openapi import openapi_document  # noqa: E402

schema = schemathesis.openapi.from_dict(openapi_document())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])

SEEN: list[Any] = []
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, Any]]:
    eng, ad, c, r, j, fake = make_parts()
    app = create_app(r, ServiceConfig(upstream_url="http://127.0.0.1:9", control_token=TOKEN,
                                      lease_s=1800))
    with uvicorn_thread(app) as url:
        yield url, app.state.gateway


#: More with ROLLOUTCORE_FUZZ_EXAMPLES (benchmarks/fuzz.py: results/fuzz.json).
EXAMPLES = min(int(os.environ.get("ROLLOUTCORE_FUZZ_EXAMPLES", "25")), 500)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much])
def test_control_api_conforms_and_rejects_bad_input(case: Any,
                                                    gateway: tuple[str, Any]) -> None:
    url, gw = gateway
    before = (gw.controller.snapshot(), gw.updates.open_update)
    resp = case.call(base_url=url, headers=dict(AUTH), timeout=30)
    case.validate_response(resp, checks=CHECKS)
    SEEN.append((case.operation.method, case.operation.path, resp.status_code))
    if resp.status_code >= 400 and case.operation.method.upper() == "POST":
        assert (gw.controller.snapshot(), gw.updates.open_update) == before


def test_zz_fuzzing_reached_past_auth_and_validation() -> None:
    """The fuzzer must have exercised real outcomes, not only 401s and 422s."""
    codes = {(m.upper(), p, s) for m, p, s in SEEN}
    if not codes:
        pytest.skip("the fuzz test did not run in this session")
    assert ("POST", "/control/updates", 201) in codes
    assert any(p == "/control/updates" and s == 422 for _, p, s in codes)
    # Under pytest-xdist schemathesis 4 runs only the first operation of the one test
    # item (its other operations are subtests of the same node id); serially, all run.
    ran = {(m, p) for m, p, _ in codes}
    if ("GET", "/control/status") in ran:
        assert ("GET", "/control/status", 200) in codes
    authed = [s for _, _, s in SEEN if s not in (401, 403)]
    assert len(authed) > len(SEEN) // 2
    from helpers.fuzzing import Tally, write_section

    tally = Tally("control_api_schemathesis", examples=len(SEEN),
                  statuses=collections.Counter(s for _, _, s in SEEN))
    tally.server_errors = [f"{m} {p} -> {s}" for m, p, s in SEEN if s >= 500]
    write_section("control_api_schemathesis", tally)
    assert not tally.server_errors
