"""The engine's adapter store (``transports.adapter_store``), driven as vLLM's app would be.

The middleware wraps an inner app that stands in for vLLM's (every other route
passes through to it). Hostile clients: no key or a wrong one, names and files
that would leave the store, bodies over the bound (declared or not), a seal
whose digest does not match what arrived, a client that leaves mid-file, a
disk that fills (a real ``RLIMIT_FSIZE`` in a child process). The trainer
half uploads a real adapter over loopback HTTP (uvicorn) with the key.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from helpers.gateway_rig import uvicorn_thread
from rolloutcore.errors import BadInput, RequestRejected
from rolloutcore.transports import adapter_store, engine_key
from rolloutcore.transports.adapter_store import (
    ENV_DIR,
    ENV_MAX,
    FILES,
    PREFIX,
    AdapterStore,
    delete_adapter,
    upload_adapter,
)
from rolloutcore.verification.adapters import AdapterSource

KEY = "k" * 40
NAME = "rcl-1-0123456789abcdef"


def make_adapter_dir(d: Path, seed: int = 0, r: int = 2) -> Path:
    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True)
    (d / FILES[0]).write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                          "target_modules": ["q_proj"]}))
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{pre}.lora_A.weight": torch.randn(r, 8, generator=g),
               f"{pre}.lora_B.weight": torch.randn(8, r, generator=g)}, str(d / FILES[1]))
    return d


async def inner(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"vllm"})


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AdapterStore:
    monkeypatch.setenv(engine_key.ENV, KEY)
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "store"))
    monkeypatch.setenv(ENV_MAX, str(1 << 20))
    return AdapterStore(inner)


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e")


H = {engine_key.HEADER: KEY}


async def raw_put(app: Any, path: str, body: bytes) -> int:
    """A PUT whose path reaches the app exactly as given; its status."""
    msgs = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[Any] = []

    async def receive() -> Any:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(m: Any) -> None:
        sent.append(m)

    await app({"type": "http", "method": "PUT", "path": path,
               "headers": [(engine_key.HEADER.encode(), KEY.encode())]}, receive, send)
    return int(sent[0]["status"])


async def _upload(c: httpx.AsyncClient, d: Path, name: str = NAME) -> None:
    for f in FILES:
        r = await c.put(f"{PREFIX}{name}/{f}", content=(d / f).read_bytes(), headers=H)
        assert r.status_code == 200, r.text


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_upload_seal_delete_and_everything_else_passes_through(
        store: AdapterStore, tmp_path: Path, anyio_backend: str) -> None:
    d = make_adapter_dir(tmp_path / "a")
    digest = AdapterSource.of(d).content_digest
    async with client(store) as c:
        assert (await c.get("/v1/models")).text == "vllm"   # not ours: passed through
        await _upload(c, d)
        r = await c.post(f"{PREFIX}{NAME}/seal", json={"content_digest": digest}, headers=H)
        assert r.status_code == 200, r.text
        where = Path(r.json()["path"])
        assert where == (store.root / NAME).resolve() and r.json()["content_digest"] == digest
        assert AdapterSource.of(where).content_digest == digest
        assert not (store.root / ".staging" / NAME).exists()
        # Sealed again with the same content: the same answer (a lost answer retried).
        r2 = await c.post(f"{PREFIX}{NAME}/seal", json={"content_digest": digest}, headers=H)
        assert r2.status_code == 200 and r2.json()["path"] == str(where)
        r3 = await c.post(f"{PREFIX}{NAME}/seal", json={"content_digest": "0" * 64}, headers=H)
        assert r3.status_code == 409
        r4 = await c.delete(f"{PREFIX}{NAME}", headers=H)
        assert r4.json() == {"deleted": True} and not where.exists()
        assert (await c.delete(f"{PREFIX}{NAME}", headers=H)).json() == {"deleted": False}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_hostile_requests_are_refused_and_leave_nothing(
        store: AdapterStore, tmp_path: Path, anyio_backend: str) -> None:
    d = make_adapter_dir(tmp_path / "a")
    other = make_adapter_dir(tmp_path / "b", seed=1)
    body = (d / FILES[1]).read_bytes()
    async with client(store) as c:
        for headers in ({}, {engine_key.HEADER: "x" * 40}):
            r = await c.put(f"{PREFIX}{NAME}/{FILES[1]}", content=body, headers=headers)
            assert r.status_code == 403
        # Raw paths (an HTTP client would normalise the dots away before sending).
        for path in (f"{PREFIX}../{FILES[1]}", f"{PREFIX}../../etc/{FILES[1]}",
                     f"{PREFIX}..%2F..%2Fetc/{FILES[1]}", f"{PREFIX}.staging/{FILES[1]}",
                     f"{PREFIX}{NAME}/..", f"{PREFIX}{NAME}/../../x",
                     f"{PREFIX}{NAME}/model.bin", f"{PREFIX}{NAME}/{FILES[0]}/x",
                     f"{PREFIX}{'a' * 200}/{FILES[0]}", f"{PREFIX}/{FILES[0]}"):
            status = await raw_put(store, path, b"{}")
            assert status in (400, 404, 405), (path, status)
        # Over the bound: declared, and (a chunked body) as it arrives.
        r = await c.put(f"{PREFIX}{NAME}/{FILES[1]}", content=b"x" * ((1 << 20) + 1),
                        headers=H)
        assert r.status_code == 413

        async def chunks() -> Any:
            for _ in range(20):
                yield b"y" * (1 << 16)

        r = await c.put(f"{PREFIX}{NAME}/{FILES[1]}", content=chunks(), headers=H)
        assert r.status_code == 413
        # A seal before both files, a bad body, the other adapter's digest.
        r = await c.post(f"{PREFIX}{NAME}/seal", json={"content_digest": "a" * 64}, headers=H)
        assert r.status_code == 409
        await _upload(c, d)
        for bad in ({"content_digest": "xyz"}, {}, [], "x" * 5000):
            r = await c.post(f"{PREFIX}{NAME}/seal", json=bad, headers=H)
            assert r.status_code in (400, 413), bad
        wrong = AdapterSource.of(other).content_digest
        r = await c.post(f"{PREFIX}{NAME}/seal", json={"content_digest": wrong}, headers=H)
        assert r.status_code == 422 and "removed" in r.json()["error"]["message"]
        # Files that are not an adapter: refused at the seal, removed.
        for f in FILES:
            r = await c.put(f"{PREFIX}{NAME}/{f}", content=b"junk", headers=H)
            assert r.status_code == 200
        r = await c.post(f"{PREFIX}{NAME}/seal", json={"content_digest": wrong}, headers=H)
        assert r.status_code == 422 and "not a LoRA adapter" in r.text
    assert sorted(p.name for p in store.root.iterdir()) == [".staging"]
    assert list((store.root / ".staging").iterdir()) == []
    assert not list(tmp_path.glob("**/etc"))


def test_a_client_that_leaves_mid_file_leaves_no_file(store: AdapterStore) -> None:
    sent: list[Any] = []
    msgs = [{"type": "http.request", "body": b"abc", "more_body": True},
            {"type": "http.disconnect"}]

    async def receive() -> Any:
        return msgs.pop(0)

    async def send(m: Any) -> None:
        sent.append(m)

    scope = {"type": "http", "method": "PUT", "path": f"{PREFIX}{NAME}/{FILES[1]}",
             "headers": [(engine_key.HEADER.encode(), KEY.encode())]}
    asyncio.run(store(scope, receive, send))
    assert sent == []   # nobody to answer
    assert list((store.root / ".staging" / NAME).iterdir()) == []


def test_without_a_route_key_uploads_are_off(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(engine_key.ENV, raising=False)
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "s"))
    s = AdapterStore(inner)

    async def go() -> httpx.Response:
        async with client(s) as c:
            return await c.put(f"{PREFIX}{NAME}/{FILES[0]}", content=b"{}",
                               headers={engine_key.HEADER: ""})

    r = asyncio.run(go())
    assert r.status_code == 403 and "uploads are off" in r.text
    monkeypatch.setenv(ENV_MAX, "many")
    with pytest.raises(BadInput):
        AdapterStore(inner)


def test_a_full_disk_is_507_and_leaves_nothing(tmp_path: Path) -> None:
    """The store in a child whose file-size limit is 64 KiB (``RLIMIT_FSIZE``): writing
    past it fails as a full disk would (EFBIG)."""
    script = textwrap.dedent(f"""
        import asyncio, os, resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        os.environ[{engine_key.ENV!r}] = {KEY!r}
        os.environ[{ENV_DIR!r}] = {str(tmp_path / "store")!r}
        from rolloutcore.transports.adapter_store import AdapterStore
        async def inner(scope, receive, send): pass
        s = AdapterStore(inner)
        msgs = [{{"type": "http.request", "body": b"z" * 50000, "more_body": True}},
                {{"type": "http.request", "body": b"z" * 50000, "more_body": False}}]
        sent = []
        async def receive(): return msgs.pop(0)
        async def send(m): sent.append(m)
        scope = {{"type": "http", "method": "PUT",
                  "path": "{PREFIX}{NAME}/{FILES[1]}",
                  "headers": [(b"{engine_key.HEADER}", b"{KEY}")]}}
        asyncio.run(s(scope, receive, send))
        print(sent[0]["status"], sent[1]["body"].decode())
        print(os.listdir(s.root / ".staging" / "{NAME}"))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("507 ") and "disk is full" in lines[0], lines
    assert lines[1] == "[]"


@pytest.fixture
def engine_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    monkeypatch.setenv(engine_key.ENV, KEY)
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "engine-store"))
    app = AdapterStore(inner)
    with uvicorn_thread(app, lifespan="off") as url:
        engine_key.register(url, KEY)
        try:
            yield url, app.root
        finally:
            engine_key.forget(url, KEY)


def test_the_trainer_uploads_over_http_and_the_engine_holds_its_own_copy(
        engine_url: tuple[str, Path], tmp_path: Path) -> None:
    url, root = engine_url
    d = make_adapter_dir(tmp_path / "trainer" / NAME)
    digest = AdapterSource.of(d).content_digest
    where = upload_adapter(url, NAME, d, digest, timeout_s=30)
    assert Path(where) == (root / NAME).resolve()
    assert AdapterSource.of(Path(where)).content_digest == digest
    # A different digest than the files: refused by the engine, nothing sealed.
    other = make_adapter_dir(tmp_path / "trainer" / "other", seed=3)
    with pytest.raises(RequestRejected, match="422"):
        upload_adapter(url, "rcl-2-0123456789abcdef", other, digest, timeout_s=30)
    assert not (root / "rcl-2-0123456789abcdef").exists()
    assert delete_adapter(url, NAME, timeout_s=30) is True
    assert not Path(where).exists()
    for bad in (("../x", d, digest), (NAME, d, "nope"), (NAME, tmp_path, digest)):
        with pytest.raises(BadInput):
            upload_adapter(url, *bad, timeout_s=30)
    assert adapter_store.MIDDLEWARE.endswith(".AdapterStore")
