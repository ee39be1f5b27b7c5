"""GlooFanout when a member cannot join the group: the others stay free (fleet #19).

A replica killed as a synchronous update starts is seen by the fan-out as a
``/get_world_size`` that fails. The group cannot be made; nothing is posted
to the members that answered, so each is reported ``closed`` (a per-engine
round to it is safe) and the coordinator sends to it alone, while the dead
one keeps its own error. The live member is the one fake of vLLM
(``FakeVllm``, served by uvicorn: it answers every route, so a call the fan-out
should not make would succeed there and is caught by what it ``received``); the
dead one is a port nobody listens on.
"""

from __future__ import annotations

import pytest

from helpers.gateway_rig import uvicorn_thread
from rolloutcore.engine.routes import Routes
from rolloutcore.testing import FakeVllm
from rolloutcore.testing.fake import FakeEngine, FakeWeights
from rolloutcore.transports.fanout import GlooFanout
from rolloutcore.transports.net import free_port

torch = pytest.importorskip("torch")


def test_a_member_that_cannot_join_leaves_the_others_free_for_per_engine_sends() -> None:
    from rolloutcore.transports.source import WeightSource

    fake = FakeVllm(FakeEngine(FakeWeights.from_seed(0), token_delay_s=0.0))
    src = WeightSource.from_state_dict({"w": torch.ones(4)})
    with uvicorn_thread(fake, lifespan="off") as live:
        dead = f"http://127.0.0.1:{free_port()}"
        fan = GlooFanout(op_timeout_s=5)
        out = fan.send_all([(live, "rc-1"), (dead, "rc-1")], src, timeout_s=20)
    ok, gone = out[live], out[dead]
    assert not ok.ok and ok.closed and not ok.sent
    assert ok.error is not None and not ok.error.mutation_started
    assert dead in str(ok.error) and "could not join" in str(ok.error)
    assert not gone.ok and not gone.closed and gone.error is not None
    assert not gone.error.mutation_started
    # nothing but the question was asked of the live one
    assert fake.received == [("GET", Routes.GET_WORLD_SIZE)]
    assert fake.engine.label == "default" and not fake.engine.paused
    assert fan.members == ()             # no group was kept


def test_when_no_member_answers_none_is_free() -> None:
    from rolloutcore.transports.source import WeightSource

    src = WeightSource.from_state_dict({"w": torch.ones(4)})
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    out = GlooFanout(op_timeout_s=5).send_all([(u, "rc-1") for u in urls], src, timeout_s=20)
    assert all(not r.ok and not r.closed and r.error is not None for r in out.values())
