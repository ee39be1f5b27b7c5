"""The gateway salts every admitted request's prefix cache by its version (issue 20)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from helpers.gateway_rig import rig
from rolloutcore.core.cache_salt import salt_for
from rolloutcore.core.versions import Binding, WeightVersion
from rolloutcore.errors import BadInput
from rolloutcore.service.salting import check_client_salt, salted_body
from rolloutcore.testing.fake import FakeWeights

pytestmark = pytest.mark.anyio

GEN = "/inference/v1/generate"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _binding(label: str = "rc-3") -> Binding:
    return Binding(WeightVersion(3, label, "e"), FakeWeights.from_seed(0).identity(), "r-1")


def test_salted_body_splices_or_folds_the_clients_salt_in() -> None:
    b = _binding()
    raw = b'{"token_ids": [1, 2], "stream": false}'
    out, salt = salted_body(raw, json.loads(raw), b)
    assert salt == salt_for(b.version) and json.loads(out) == {
        "token_ids": [1, 2], "stream": False, "cache_salt": salt}
    raw2 = b'{"token_ids": [1], "cache_salt": "tenant-7"}'
    out2, salt2 = salted_body(raw2, json.loads(raw2), b)
    assert salt2 == salt_for(b.version, "tenant-7") != salt
    assert json.loads(out2)["cache_salt"] == salt2
    out3, _ = salted_body(b"{}", {}, b)
    assert json.loads(out3) == {"cache_salt": salt}
    for bad in ("", 7, "a/b", "x" * 1025):
        assert check_client_salt({"cache_salt": bad})
    assert check_client_salt({}) == "" and check_client_salt({"cache_salt": "ok"}) == ""
    with pytest.raises(BadInput):
        salted_body(b'{"cache_salt": 1}', {"cache_salt": 1}, b)


async def test_the_gateway_salts_by_the_version_and_refuses_a_bad_salt() -> None:
    async with rig() as r:
        resp = await r.client.post(GEN, json={"token_ids": [1, 2, 3],
                                              "sampling_params": {"max_tokens": 3}})
        assert resp.status_code == 200
        c0 = r.controller.committed
        assert c0 is not None
        assert r.fake.bodies[-1]["cache_salt"] == salt_for(c0)
        n, recs = len(r.fake.bodies), len(r.journal.records)
        resp = await r.client.post(GEN, json={"token_ids": [1], "cache_salt": "a@b",
                                              "sampling_params": {"max_tokens": 3}})
        assert resp.status_code == 400 and "cache_salt" in resp.text
        assert len(r.fake.bodies) == n and len(r.journal.records) == recs  # not admitted


async def test_the_salt_follows_the_committed_version_and_can_be_turned_off() -> None:
    for salted in (True, False):
        async with rig(salt_prefix_cache=salted) as r:
            body: dict[str, Any] = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}}
            assert (await r.client.post(GEN, json=body)).status_code == 200
            first = r.fake.bodies[-1].get("cache_salt")
            w1 = FakeWeights.from_seed(1, step=1)
            r.adapter.stage(w1)
            r.runner.run_update(w1.identity())
            assert (await r.client.post(GEN, json=body)).status_code == 200
            second = r.fake.bodies[-1].get("cache_salt")
            c1 = r.controller.committed
            assert c1 is not None and c1.label == "rc-1"
            if salted:
                assert second == salt_for(c1) != first
            else:
                assert first is None and second is None
