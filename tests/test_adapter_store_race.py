"""The adapter store seals exactly the bytes it digested, and answers every failure 4xx/507
(#47, symptom 10).

Before: a file upload that landed while a seal was digesting was sealed in (the
seal answered digest D, the directory held D'); two seals of one name answered
200 and 500; a staging directory that could not be made answered 500. Driven as
vLLM's app drives the middleware (``tests/test_adapter_store.py``'s rig), the
digest slowed so that the other request lands inside it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from helpers.fault_matrix import PromiseRows
from rolloutcore.transports import adapter_store
from rolloutcore.transports.adapter_store import FILES, PREFIX, AdapterStore
from rolloutcore.verification.adapters import AdapterSource
from test_adapter_store import NAME, H, _upload, client, make_adapter_dir, store  # noqa: F401

MATRIX = PromiseRows("tests/test_adapter_store_race.py",
                     engines="the engine's adapter store (ASGI middleware) driven in process")
_fault_matrix = MATRIX.fixture()
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def slow_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    real = adapter_store._digest

    def slow(d: Path) -> str:
        time.sleep(0.4)
        return real(d)

    monkeypatch.setattr(adapter_store, "_digest", slow)


async def test_an_upload_during_a_seal_is_never_sealed_in(
        store: AdapterStore, tmp_path: Path, slow_digest: None) -> None:  # noqa: F811
    a = make_adapter_dir(tmp_path / "a")
    b = make_adapter_dir(tmp_path / "b", seed=1)
    want = AdapterSource.of(a).content_digest
    async with client(store) as c:
        await _upload(c, a)
        seal = asyncio.ensure_future(c.post(f"{PREFIX}{NAME}/seal",
                                            json={"content_digest": want}, headers=H))
        await asyncio.sleep(0.15)          # the seal is digesting
        put = await c.put(f"{PREFIX}{NAME}/{FILES[1]}", content=(b / FILES[1]).read_bytes(),
                          headers=H)
        r = await seal
    assert r.status_code == 200 and r.json()["content_digest"] == want, r.text
    assert put.status_code in (200, 409), put.text
    assert AdapterSource.of(Path(r.json()["path"])).content_digest == want  # what it said
    MATRIX.row("adapter_store_race", "a file upload lands while the seal digests",
               f"the seal answered its digest and the sealed directory holds it; the "
               f"upload answered {put.status_code} (not sealed in)", "sealed as answered",
               published_unvalidated=0, records_lost=0, part="upload during seal")


async def test_two_seals_of_one_name_both_answer_what_was_sealed(
        store: AdapterStore, tmp_path: Path, slow_digest: None) -> None:  # noqa: F811
    a = make_adapter_dir(tmp_path / "a")
    want = AdapterSource.of(a).content_digest
    async with client(store) as c:
        await _upload(c, a)
        rs = await asyncio.gather(*(c.post(f"{PREFIX}{NAME}/seal",
                                           json={"content_digest": want}, headers=H)
                                    for _ in range(2)))
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    assert {r.json()["content_digest"] for r in rs} == {want}
    MATRIX.row("adapter_store_race", "two seals of one name at once",
               "both answer 200 with what was sealed", "sealed once",
               published_unvalidated=0, records_lost=0, part="two seals")


async def test_a_staging_directory_that_cannot_be_made_is_a_507(
        store: AdapterStore, tmp_path: Path) -> None:  # noqa: F811
    a = make_adapter_dir(tmp_path / "a")
    staging = store.root / ".staging"
    staging.rmdir()
    staging.write_text("not a directory")   # what a full or broken store looks like
    async with client(store) as c:
        r = await c.put(f"{PREFIX}{NAME}/{FILES[0]}", content=(a / FILES[0]).read_bytes(),
                        headers=H)
    assert r.status_code == 507, r.text
    assert "cannot stage" in r.json()["error"]["message"]
    MATRIX.row("adapter_store_race", "the staging directory cannot be made",
               "507 with the reason (was 500)", "nothing staged",
               published_unvalidated=0, records_lost=0, part="staging fails")
