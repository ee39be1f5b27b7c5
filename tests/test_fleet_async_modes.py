"""A fleet carries requests across updates under keep and recompute as one engine does.

Found on the H200 (2026-12-03, ``diagnostics/gpu/h200_fleet.py``): behind the fleet's
router the data plane had no carried relay at all (it was built for "the one engine's
controller" only), so under ``recompute`` every stream the update's pause aborted ended
short (167 failed requests in 20 s), and under ``keep`` no answer said which version
produced which token. Each replica's controller now has its relay (``DataPlane.relay_for``),
the one ``service.carried`` machinery: these tests are the single engine's
(``test_gateway_async_modes``) through the fleet gateway, fake engines behind real HTTP.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from fleettools import fake_fleet, fleet_client, weights
from helpers.gateway_rig import sse_events
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import UpdateMode
from rolloutcore.core.lifecycle_state import ControllerConfig
from rolloutcore.fleet import FleetConfig
from rolloutcore.provenance.token_versions import TokenVersions
from rolloutcore.service.proxy import BODY_FIELD

pytestmark = pytest.mark.anyio
GEN = "/inference/v1/generate"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _body(n: int) -> dict[str, Any]:
    return {"token_ids": [5, 6, 7, 8, 9, 10, 11, 12], "stream": True,
            "sampling_params": {"max_tokens": n}}


async def _stream_across_an_update(mode: UpdateMode) -> tuple[Any, list[Any], Any, Any]:
    f = fake_fleet(2, token_delay_s=0.01, config=FleetConfig(health_interval_s=0),
                   controller_kw={"config": ControllerConfig(update_mode=mode)})
    async with fleet_client(fleet=f) as (f, client, _):
        got: list[httpx.Response] = []

        async def run() -> None:
            got.append(await client.post(GEN, json=_body(40)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(10):
                while not any(v >= 3 for n in f.adapters
                              for v in f.engine(n).tokens_in_flight().values()):
                    await anyio.sleep(0.005)
            # The stream must still run when the update lands, however slowly a loaded
            # machine runs it (37 tokens left at 0.01 s = 0.37 s): 10x slower until the
            # new weights are written into its engine, then the rest at once (and the
            # update's probes after that, which were generated at 0.1 s a token too).
            done = anyio.Event()
            out: list[Any] = []

            async def update() -> None:
                try:
                    out.append(await anyio.to_thread.run_sync(f.coord.update, weights(1)))
                finally:
                    done.set()

            async def quicken_once_written(engine: Any) -> None:
                ops = engine.weight_ops
                engine.token_delay_s = 0.1
                while engine.weight_ops == ops and not done.is_set():
                    await anyio.sleep(0.005)
                engine.token_delay_s = 0.0

            for n in f.adapters:
                tg.start_soon(quicken_once_written, f.engine(n))
            tg.start_soon(update)
        res = out[0]
        resp = got[0]
        assert resp.status_code == 200, resp.text
        return f, sse_events(resp.text), resp.headers, res


@pytest.mark.parametrize("mode", [UpdateMode.KEEP, UpdateMode.RECOMPUTE])
async def test_a_stream_crosses_a_fleet_update_whole_and_says_which_version_made_each_token(
        mode: UpdateMode) -> None:
    f, evs, headers, res = await _stream_across_an_update(mode)
    assert res.published is not None
    assert evs[-1] == "[DONE]"
    data = [e for e in evs[:-1] if isinstance(e, dict) and e.get("choices")]
    toks = [t for e in data for c in e["choices"] for t in c.get("token_ids") or ()]
    assert len(toks) == 40                       # nothing lost at the pause
    finishes = [e["choices"][0].get("finish_reason") for e in data]
    assert finishes[-1] == "length" and "abort" not in finishes
    info = evs[-2][BODY_FIELD]
    replica = info["replica"]
    tv = TokenVersions.from_dict(info["token_versions"])
    labels = [s.label for s in tv.spans]
    assert len(labels) == 2 and tv.spans[0].start == 0 and tv.spans[-1].end == 40
    ctl = f.coord.replicas[replica].controller
    assert ctl.committed is not None and labels[-1] == ctl.committed.label
    if mode is UpdateMode.RECOMPUTE:
        assert [s.kv for s in tv.spans] == [(labels[0],), (labels[1],)]  # no cross-version KV
        assert len(tv.segments) == 2
    else:
        assert len(tv.segments) == 1             # one engine request, frozen and continued
    for j in f.journals.values():
        assert check_journal(j.records) == []
