"""The hot path's per-layout work, done once, never lets a changed layout through.

``PackedWeights`` derives its zero-copy test, names, size and checksum program
from its layout once; ``WeightSource.checked_tensors`` checks a state dict's
tensors in a few C-level passes; the transport makes the validation's digests
at staging; the runner reuses its effect workers. Each test here holds the
fast form to the per-tensor form it replaces: the same answer for the same
input, and every change that matters (a renamed, reshaped, re-typed or moved
tensor, a new buffer, another offset, other strides) seen on the next call.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import httpx
import pytest
import torch

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.errors import BadInput, EffectError, EffectTimeout
from rolloutcore.transports import engine_key
from rolloutcore.transports.cuda_ipc import CudaIpcTransport, PackedWeights, block_checksum
from rolloutcore.transports.cuda_ipc.wire import names_digest
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.checksums import EMPTY_SHA256, compare, unverifiable_value

SPECS = [("a.weight", (8, 4), torch.bfloat16), ("b.bias", (6,), torch.float32),
         ("c.weight", (4, 4), torch.float16), ("d.norm", (6,), torch.bfloat16)]


def _packed(seed: int = 0) -> PackedWeights:
    pk = PackedWeights(SPECS, device="cpu")
    g = torch.Generator().manual_seed(seed)
    pk.buffer.copy_(torch.randint(0, 255, pk.buffer.shape, dtype=torch.uint8, generator=g))
    return pk


def _both(pk: PackedWeights, named: list[tuple[str, torch.Tensor]]) -> bool:
    """``holds`` (per tensor) and ``holds_tensors`` (C-level passes) agree; their answer."""
    slow = pk.holds(named)
    fast = pk.holds_tensors(tuple(n for n, _ in named), [t for _, t in named])
    assert slow == fast, (slow, fast)
    return fast


def test_zero_copy_test_sees_every_change_that_matters() -> None:
    pk = _packed()
    views = list(pk.items())
    assert _both(pk, views)
    assert _both(pk, [(n, t.view(t.shape)) for n, t in views])  # new objects, same place
    # A module bound to the buffer (parameters are other objects over the same bytes).
    mod = torch.nn.Module()
    for n, t in views:
        mod.register_parameter(n.replace(".", "_"), torch.nn.Parameter(t.clone()))
    assert _both(pk, [(n, getattr(mod, n.replace(".", "_"))) for n, _ in views]) is False
    for i, (name, t) in enumerate(views):
        alt: list[list[tuple[str, torch.Tensor]]] = []
        alt.append([*views[:i], (name + "x", t), *views[i + 1:]])             # renamed
        alt.append([*views[:i], (name, t.reshape(-1, 1)), *views[i + 1:]])    # reshaped
        other = torch.float16 if t.dtype == torch.bfloat16 else torch.bfloat16
        if t.element_size() == 2:
            alt.append([*views[:i], (name, t.view(other)), *views[i + 1:]])   # re-typed
        alt.append([*views[:i], (name, t.clone()), *views[i + 1:]])           # elsewhere
        off = pk.entries[i].offset_bytes + 4  # another offset in the same buffer
        assert off + t.numel() * t.element_size() <= pk.buffer.numel()
        raw = pk.buffer[off:off + t.numel() * t.element_size()]
        alt.append([*views[:i], (name, raw.view(t.dtype).view(t.shape)), *views[i + 1:]])
        alt.append(views[:i] + views[i + 1:])                                 # missing
        alt.append([*views[:i], views[(i + 1) % len(views)], *views[i + 1:]])  # duplicate
        for k, named in enumerate(alt):
            assert _both(pk, named) is False, (name, k)
    # Other strides over the same bytes: a square matrix transposed.
    c = pk.tensor("c.weight")
    assert _both(pk, [(n, c.t() if n == "c.weight" else t) for n, t in views]) is False
    # A new buffer of the very same layout is not this one.
    p2 = _packed()
    assert _both(p2, list(p2.items())) is True
    assert _both(pk, list(p2.items())) is False and _both(p2, views) is False
    # The names must be in entry order for holds_tensors; holds takes any order.
    rev = views[::-1]
    assert pk.holds(rev) and not pk.holds_tensors([n for n, _ in rev], [t for _, t in rev])


def test_a_view_moved_after_the_buffer_was_made_is_not_held() -> None:
    pk = _packed()
    views = list(pk.items())
    assert _both(pk, views)
    v = pk.tensor("b.bias")
    v.set_(torch.zeros(6, dtype=torch.float32))  # the object itself, now elsewhere
    assert _both(pk, views) is False
    # The checksum then hashes what the views hold, as block_checksum does.
    assert pk.checksum("torch") == block_checksum([t for _, t in views], impl="torch")


def test_checksum_and_derived_layout_equal_the_per_call_forms() -> None:
    pk = _packed(3)
    assert pk.names() is pk.names() and pk.names() == tuple(e.name for e in pk.entries)
    assert pk.nbytes == sum(e.nbytes for e in pk.entries)
    ref = block_checksum([pk.tensor(e.name) for e in pk.entries], impl="torch")
    assert pk.checksum("torch") == ref == pk.checksum("auto")
    pk.buffer[:64] += 1
    assert pk.checksum("torch") != ref


def test_checked_tensors_see_a_state_dict_changed_under_the_source() -> None:
    pk = _packed()
    state = dict(pk.items())
    src = WeightSource.from_state_dict(state)
    names, ts = src.checked_tensors() or ((), [])
    assert names == tuple(sorted(state))
    assert all(t is state[n] for n, t in zip(names, ts, strict=True))
    assert [n for n, _ in src.named_tensors()] == list(names)
    changes = [lambda t: setattr(t, "data", t.data.reshape(-1, 1)),       # reshaped
               lambda t: setattr(t, "data", t.data.to(torch.float64)),    # re-typed
               lambda t: t.resize_(t.numel() + 2)]                        # resized
    for change in changes:
        for name in names:
            src = WeightSource.from_state_dict({n: t.clone() for n, t in state.items()})
            t = src.checked_tensors()[1][names.index(name)]  # type: ignore[index]
            change(t)
            with pytest.raises(BadInput) as slow:
                list(src.named_tensors())
            with pytest.raises(BadInput) as fast:
                src.checked_tensors()
            assert str(fast.value) == str(slow.value) and name in str(fast.value)
    # Other sources have no fixed tensors: the transport takes the general path.
    assert WeightSource(list(src._entries), src.named_tensors, "gen").checked_tensors() is None


class _NoEngine(CudaIpcTransport):
    pass


def test_transport_sends_the_adopted_buffer_only_while_the_source_is_its_views() -> None:
    from rolloutcore.transports.cuda_ipc.trainer import SendTimings

    pk = _packed(5)
    tr = _NoEngine(device="cpu")
    tr.adopt(pk)
    state = dict(pk.items())
    src = WeightSource.from_state_dict(state)
    assert tr._packed(src, SendTimings()) is pk and tr.last_zero_copy
    # Same answer as the general path (a plain list of pairs: per-tensor holds).
    assert tr._packed(list(src.named_tensors()), SendTimings()) is pk
    # One tensor moved (same shape and dtype, other memory): copied, never the buffer.
    state["b.bias"].data = torch.full((6,), 7.0)
    got = tr._packed(src, SendTimings())
    assert got is not pk and not tr.last_zero_copy
    assert torch.equal(got.tensor("b.bias"), torch.full((6,), 7.0))
    assert torch.equal(got.tensor("a.weight"), pk.tensor("a.weight"))
    # A new buffer of the same layout is adopted separately; the first is not it.
    pk2 = _packed(6)
    src2 = WeightSource.from_state_dict(dict(pk2.items()))
    assert tr._packed(src2, SendTimings()) is not pk2  # not adopted: copied
    tr.adopt(pk2)
    assert tr._packed(src2, SendTimings()) is pk2


def test_digests_are_made_at_staging_and_follow_every_new_set_of_values() -> None:
    from rolloutcore.transports.cuda_ipc.checksum import checksum_digest

    pk = _packed(7)
    tr = _NoEngine(device="cpu", checksum_impl="torch")
    tr.precompute_checksum(pk)
    vals = tr._pre[1] if tr._pre else []
    assert tr._digest_cache is not None and tr._digest_cache[1] is vals
    nd, cd, exp = tr._digests(pk.names(), vals)
    assert nd == names_digest(list(pk.names()))
    assert cd == checksum_digest(pk.names(), vals)
    assert exp == dict(zip(pk.names(), vals, strict=True))
    other = [v + 1 for v in vals]  # the next update's values: recomputed, never reused
    nd2, cd2, exp2 = tr._digests(pk.names(), other)
    assert nd2 == nd and cd2 == checksum_digest(pk.names(), other) != cd
    assert exp2 == dict(zip(pk.names(), other, strict=True))
    eq_copy = list(other)  # equal content, another object: still recomputed (identity key)
    assert tr._digests(pk.names(), eq_copy)[1] == cd2 and tr._digest_cache[1] is eq_copy


def test_compare_default_rule_is_the_generic_rule() -> None:
    rng = random.Random(11)
    pool: list[Any] = [None, EMPTY_SHA256, 1, 2, 3, "x", "y", 0]
    for _ in range(400):
        keys = [f"k{i}" for i in range(rng.randint(0, 8))]
        eng = {k: rng.choice(pool) for k in keys if rng.random() < 0.8}
        ref = {k: rng.choice(pool) for k in keys if rng.random() < 0.8}
        fast = compare(eng, ref, keyed_by="position")
        slow = compare(eng, ref, keyed_by="position",
                       unverifiable=lambda v: unverifiable_value(v))
        assert fast == slow


def test_engine_key_headers_follow_register_and_forget() -> None:
    url = "http://hot-path.test:1234"
    assert engine_key.headers_for(url) == {}
    key = engine_key.new_key()
    engine_key.register(url, key)
    try:
        assert engine_key.headers_for(url) == {engine_key.HEADER: key}
        assert engine_key.headers_for(url + "/") == {engine_key.HEADER: key}
    finally:
        engine_key.forget(url)
    assert engine_key.headers_for(url) == {}
    assert engine_key.headers_for("not a url") == {}


def test_vllm_http_sends_to_the_same_urls_with_a_base_path() -> None:
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(str(req.url))
        return httpx.Response(200, json={"status": "paused", "is_paused": True})

    h = VllmHTTP("http://e.test:9/prefix/", transport=httpx.MockTransport(handler))
    from rolloutcore.core.evidence import PauseMode

    h.pause(PauseMode.WAIT)
    h.pause(PauseMode.WAIT)
    assert h.is_paused()
    assert seen == ["http://e.test:9/prefix/pause?mode=wait&clear_cache=false"] * 2 + [
        "http://e.test:9/prefix/is_paused"]


class _Stuck:
    caches = ()

    def __init__(self) -> None:
        self.release = threading.Event()
        self.cancelled: list[Any] = []

    def cancel(self, step: Any) -> None:
        self.cancelled.append(step)


def test_effect_workers_are_reused_and_every_deadline_still_holds() -> None:
    ad = _Stuck()
    r = LifecycleRunner(LifecycleController(), ad,  # type: ignore[arg-type]
                        Deadlines(cancel_grace_s=0.05))
    for _ in range(5):  # warm
        r._effect("health", lambda: 1, 5.0, None)
    before = threading.active_count()
    names = [r._effect("health", lambda: threading.current_thread().name, 5.0, None)
             for _ in range(50)]
    assert set(names) == {"rolloutcore-health"}
    assert threading.active_count() <= before + 1  # reused, not one thread per effect

    # A stuck effect: the deadline expires, the adapter is cancelled, and the next
    # effect runs at once on another worker, not behind the stuck one.
    t = time.monotonic()
    with pytest.raises(EffectTimeout):
        r._effect("health", lambda: ad.release.wait(30), 0.1, None)
    assert time.monotonic() - t < 5 and len(ad.cancelled) == 1
    assert r._effect("health", lambda: 2, 5.0, None) == 2
    ad.release.set()

    def boom() -> None:
        raise ValueError("no")

    with pytest.raises(EffectError, match="ValueError: no"):
        r._effect("health", boom, 5.0, None)
    ee = EffectError("health", "mine")

    def raise_ee() -> None:
        raise ee

    with pytest.raises(EffectError) as got:
        r._effect("health", raise_ee, 5.0, None)
    assert got.value is ee
    # Effects from several threads at once each get a worker.
    out: list[int] = []
    ths = [threading.Thread(target=lambda i=i: out.append(
        r._effect("health", lambda: (time.sleep(0.05), i)[1], 5.0, None))) for i in range(6)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(10)
    assert sorted(out) == list(range(6))
