"""rc_cuda_ipc across a sleep (issue 21): what the worker half keeps, and drops on a wake.

vLLM's sleep (CuMemAllocator) releases the weights' physical memory and maps
new memory at the same addresses when they wake: at level 2 it holds
anything. Played on the CPU with the loader's own code: a checksum
prefetched before the sleep would still "verify" the old weights after such
a wake (the hazard), ``SliceLoader.invalidate`` drops it so the check reads
the memory again; parameters that moved (another sleep backend) drop the
plan and the programs too. The trainer half's wake methods (every
parameter's checksum, the workers' memory, the whole-parameter check) are
checked against the replies its RPCs parse.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rolloutcore.errors import EngineUnavailable
from rolloutcore.transports.cuda_ipc import ROW_HEADER, CudaIpcTransport, SliceLoader
from rolloutcore.verification.checksums import compare_lists
from test_cuda_ipc_unit import _message_for, _packed, _TinyModel


def _garbage_in_place(model: torch.nn.Module) -> None:
    """What a level-2 wake leaves: the same addresses, other contents."""
    with torch.no_grad():
        for p in model.parameters():
            p.data.view(torch.uint8).fill_(0x5A)


def test_a_checksum_prefetched_before_the_sleep_would_verify_garbage() -> None:
    pk = _packed(31)
    model = _TinyModel()
    loader = SliceLoader(model)
    loader.load([pk.buffer], _message_for(pk, "fast"))
    assert loader.prefetch_checksum()
    _garbage_in_place(model)
    stale = loader.checksum()
    assert stale["prefetched"] and stale["values"] == pk.checksum(), \
        "the prefetch describes the memory before the sleep"


def test_invalidate_after_a_wake_makes_the_check_read_the_memory_again() -> None:
    pk = _packed(32)
    model = _TinyModel()
    loader = SliceLoader(model)
    loader.load([pk.buffer], _message_for(pk, "fast"))
    loader.prefetch_checksum()
    plan = loader._plan
    _garbage_in_place(model)
    got = loader.invalidate()
    assert got == {"dropped": ["prefetched checksum"], "params_moved": False}
    assert loader._plan is plan, "the addresses held: the plan is kept"
    fresh = loader.checksum()
    assert not fresh["prefetched"] and fresh["values"] != pk.checksum()
    # The colocated update writes the weights again: the check then holds.
    loader.load([pk.buffer], _message_for(pk, "fast"))
    assert loader.checksum()["values"] == pk.checksum()
    assert loader.stats["invalidated"] == got
    assert loader.invalidate() == {"dropped": [], "params_moved": False}


def test_parameters_that_moved_across_the_sleep_drop_the_plan_and_programs() -> None:
    pk = _packed(33)
    model = _TinyModel()
    loader = SliceLoader(model)
    msg = _message_for(pk, "fast")
    loader.load([pk.buffer], msg)
    loader.prefetch_checksum()
    row = torch.zeros(ROW_HEADER + len(pk.entries), dtype=torch.int64)
    assert loader.publish_checksum(row, 7)
    for p in model.parameters():  # re-created at other addresses
        p.data = torch.full_like(p.data, 0.5)
    got = loader.invalidate()
    assert got["params_moved"] and "slice plan" in got["dropped"]
    assert loader._plan is None and loader._prog is None and loader._row_head is None
    loader.load([pk.buffer], msg)
    assert loader.stats["plan_cached"] is False
    assert loader.checksum()["values"] == pk.checksum()
    row2 = torch.zeros_like(row)
    assert loader.publish_checksum(row2, 8)
    assert row2[ROW_HEADER:].tolist() == pk.checksum()


def _transport(replies: dict[str, list[Any]]) -> CudaIpcTransport:
    tr = CudaIpcTransport(device="cpu")
    calls: list[str] = []

    def rpc(base_url: str, method: str, *args: str, timeout_s: float = 60.0) -> list[Any]:
        calls.append(method)
        return replies[method]

    tr.rpc = rpc  # type: ignore[method-assign]
    tr.calls = calls  # type: ignore[attr-defined]
    return tr


def test_param_checksums_name_every_engine_parameter_and_refuse_bad_replies() -> None:
    one = {"names": ["a", "b"], "values": [1, 2], "elapsed_s": 0.1}
    tr = _transport({"rc_cuda_ipc_param_checksums": [one]})
    assert tr.param_checksums("http://e") == {"a": 1, "b": 2}
    tr = _transport({"rc_cuda_ipc_param_checksums": [{**one, "rank": 0}, {**one, "rank": 1}]})
    assert tr.param_checksums("http://e") == {"tp0:a": 1, "tp0:b": 2, "tp1:a": 1, "tp1:b": 2}
    for bad in ({"names": ["a"], "values": [1, 2]}, {"values": [1]}, "x"):
        with pytest.raises(EngineUnavailable):
            _transport({"rc_cuda_ipc_param_checksums": [bad]}).param_checksums("http://e")


def test_engine_memory_sums_the_workers_and_says_where_it_comes_from() -> None:
    w = {"free_bytes": 10, "total_bytes": 100, "used_bytes": 90,
         "cumem_weights_mapped_bytes": 40, "bogus": True, "neg": -1}
    m = _transport({"rc_cuda_ipc_memory": [w, w]}).engine_memory("http://e")
    assert m["used_bytes"] == 180 and m["cumem_weights_mapped_bytes"] == 80
    assert "bogus" not in m and "neg" not in m and "cudaMemGetInfo" in m["source"]
    tr = _transport({"rc_cuda_ipc_after_wake": [{"dropped": [], "params_moved": False}]})
    tr._expect = object()  # type: ignore[assignment]
    assert tr.after_wake("http://e")["workers"][0]["params_moved"] is False
    assert tr._expect is None, "a result slot filled before the sleep describes nothing"


def test_the_whole_parameter_check_counts_the_engines_parameters() -> None:
    pk = _packed(34)
    tr = _transport({})
    assert tr.engine_parameter_check() is None
    tr.last_sent_checksum, tr.last_sent_names = pk.checksum(), pk.names()
    tr._n_params["http://e"] = 7
    from rolloutcore.transports.cuda_ipc import names_digest

    full = {"values": list(tr.last_sent_checksum), "names_digest": names_digest(pk.names())}
    tr.rpc = lambda *a, **k: [{**full, "n_uncovered": 0}]  # type: ignore[method-assign]
    tr.engine_checksum("http://e")
    c = tr.engine_parameter_check()
    assert c is not None and c.passed and c.coverage == 1.0
    tr.rpc = lambda *a, **k: [{**full, "n_uncovered": 1}]  # type: ignore[method-assign]
    tr.engine_checksum("http://e")
    c = tr.engine_parameter_check()
    assert c is not None and not c.passed and c.coverage == pytest.approx(6 / 7)
    assert "6/7" in c.detail
    # Values compared with the same rule the trainer uses: a list of what was sent.
    assert compare_lists(pk.names(), pk.checksum(), pk.names(), pk.checksum()).complete
