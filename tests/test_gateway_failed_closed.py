"""A gateway failed closed says so on ``/health`` and in its status (#47, symptom 5).

After its journal hit ENOSPC on a data-plane record the gateway answered every
request 503 "do not retry", for ever, while ``/health`` answered 200 "ok" and
the status said READY: no orchestrator restarted it. In process, over the
fake vLLM (``helpers.gateway_rig``).
"""

from __future__ import annotations

from typing import Any

import pytest

from fleettools import fake_fleet, fleet_client, weights
from helpers.fault_matrix import PromiseRows
from helpers.gateway_rig import AUTH, rig
from rolloutcore.core.lifecycle import State
from rolloutcore.core.pool import ReplicaStateChange
from rolloutcore.core.records import Record
from rolloutcore.errors import JournalError
from rolloutcore.fleet import FleetUpdateFailed

pytestmark = pytest.mark.anyio
GEN = "/inference/v1/generate"
BODY = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}
MATRIX = PromiseRows("tests/test_gateway_failed_closed.py",
                     engines="FakeEngine behind the real gateway (in process)")
_fault_matrix = MATRIX.fixture()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_journal_full_on_a_request_record_makes_health_say_failed_closed() -> None:
    async with rig() as r:
        assert (await r.client.get("/health")).json()["status"] == "ok"

        def full(rec: Record) -> None:
            if rec.KIND == "admit":
                raise OSError(28, "No space left on device")

        r.controller.add_listener(full)
        first = await r.client.post(GEN, json=BODY)
        assert first.status_code in (200, 503)
        # The controller stays READY (no update was running) but refuses everything.
        assert r.controller.state is State.READY
        assert r.controller.failed_closed is not None
        refused = await r.client.post(GEN, json=BODY)
        assert refused.status_code == 503
        h = await r.client.get("/health")
        assert h.status_code == 503, h.text
        assert h.json()["status"] == "failed_closed" and h.json()["state"] == "READY"
        assert "No space left" in h.json()["reason"]
        st = (await r.client.get("/control/status", headers=AUTH)).json()
        assert st["health"] == "failed_closed" and "No space left" in st["failed_closed"]
    MATRIX.row("failed_closed_health",
               "the journal fails (ENOSPC) on a request's record while READY",
               "every request refused 503; /health 503 status=failed_closed with the reason; "
               "status health=failed_closed", "READY (failed closed)",
               published_unvalidated=0, records_lost=0)


async def test_a_healthy_gateway_says_ok_in_its_status() -> None:
    async with rig() as r:
        st = (await r.client.get("/control/status", headers=AUTH)).json()
        assert st["health"] == "ok" and st["failed_closed"] is None


async def test_a_fleet_failed_closed_says_so_on_health() -> None:
    f = fake_fleet(2)
    j = f.coord.journal
    orig = j.write

    count = {"n": 0}

    # as tests/test_fleet_promises.py's journal that fails mid-update
    def full(rec: Any, **kw: Any) -> Any:
        if isinstance(rec, ReplicaStateChange) and rec.event == "selected":
            count["n"] += 1
            if count["n"] == 2:
                raise JournalError("cannot write: no space left on device")
        return orig(rec, **kw)

    async with fleet_client(fleet=f) as (_, client, _fakes):
        assert (await client.get("/health")).status_code == 200
        j.write = full  # type: ignore[method-assign]
        try:
            with pytest.raises(FleetUpdateFailed):
                f.coord.update(weights(1))
        finally:
            j.write = orig  # type: ignore[method-assign]
        assert f.coord.failed_closed is not None
        h = await client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed_closed", h.text
        assert "no space" in h.json()["reason"]
