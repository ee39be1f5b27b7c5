"""Forged CUDA IPC handles against the ``rc_cuda_ipc`` receiver (torch only, no vLLM).

A producer process (this one: the "trainer") allocates a 64 MiB device buffer
(its own cudaMalloc segment: the allocation is exactly the storage), fills it
with a known pattern and shares it with ``share_buffer``. A consumer process
(the "engine", spawned) receives the JSON handle and, for every case, forges
one field and drives the receiver's own functions: ``BufferHandle.from_json``
/ ``decode_update`` (the wire checks), ``check_ref_counter_file`` and
``map_buffer`` (counter file before the open; declared storage against the
allocation the driver really mapped, ``cuMemGetAddressRange``, after it).
Each case records where it was refused (``stage``), whether the handle was
opened at all, and the error. A refused mapping is never read or written; at
the end the producer checks its buffer still holds the pattern (nothing was
written through a forged mapping, the result-slot case included) and records
its reference-counter slots. A second producer with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` shares an expandable
segment ("e" handle) to see whether its real size can be shown.

    PYTHONPATH=src python3 diagnostics/gpu/forged_handles.py --out $OUT
    PYTHONPATH=src python3 diagnostics/gpu/forged_handles.py --plan --out DIR

``--plan`` needs no GPU: it runs every case that can run without one (wire
checks, the counter-file checks against files it makes in a temporary
directory, the range checks on synthetic numbers) and lists the others as not
run. Writes ``forged-handles.json`` into ``--out``; exit 1 if a case that ran
did not end as expected.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutcore.errors import BadInput
from rolloutcore.transports.cuda_ipc.loader import check_mapped_range, check_ref_counter_file
from rolloutcore.transports.cuda_ipc.wire import (
    REF_COUNTER_FILE_BYTES,
    REF_COUNTER_SLOTS,
    BufferHandle,
    EntrySpec,
    ResultSlot,
    UpdateMessage,
    decode_update,
    encode_update,
    handle_kind,
)

BUF_BYTES = 64 << 20
SHM_DIR = "/dev/shm"
PLAN_UUID = "GPU-00000000-0000-0000-0000-000000000000"

# ------------------------------------------------------------------ the cases
#
# A case forges the legit handle's JSON (``forge(h, facts) -> json``) at one of
# three levels: "wire" (the decoder must refuse), "file" (the counter file must be
# refused before the open), "map" (needs the real mapping: the range check or CUDA
# must refuse after the open, before any read). ``expect``: "refused", "mapped",
# or "either" (recorded, not judged).

Forge = Callable[[dict[str, Any], dict[str, Any]], Any]


def _with(**kw: Any) -> Forge:
    return lambda h, facts: {**h, **kw}


def _b64(b: bytes) -> str:
    import base64

    return base64.b64encode(b).decode()


def _message(h: dict[str, Any], facts: dict[str, Any], **over: Any) -> dict[str, Any]:
    """An ``update_info`` of one entry over the handle (the engine's decode path)."""
    b = BufferHandle.from_json(h)
    msg = UpdateMessage("fast", (b,), (EntrySpec("w", "float32", (16,), 0, 0),))
    body = encode_update(msg)
    body.update(over)
    return body


CASES: list[dict[str, Any]] = [
    # -- wire: refused by the decoder, before anything is opened
    {"name": "nbytes beyond the declared storage", "level": "wire",
     "forge": lambda h, f: {**h, "nbytes": h["storage_size_bytes"] + 1}},
    {"name": "tensor offset past the storage", "level": "wire",
     "forge": lambda h, f: {**h, "tensor_offset_bytes": h["storage_size_bytes"]}},
    {"name": "ref counter offset at the end of the file", "level": "wire",
     "forge": _with(ref_counter_offset=REF_COUNTER_SLOTS)},
    {"name": "ref counter offset far out of range", "level": "wire",
     "forge": _with(ref_counter_offset=1 << 40)},
    {"name": "negative ref counter offset", "level": "wire",
     "forge": _with(ref_counter_offset=-8)},
    {"name": "ref counter names a path", "level": "wire",
     "forge": _with(ref_counter_handle=_b64(b"/../../etc/passwd"))},
    {"name": "ref counter name with a trailing newline", "level": "wire",
     "forge": lambda h, f: {**h, "ref_counter_handle": _b64(f["ref_name"].encode() + b"\n")}},
    {"name": "unknown handle kind", "level": "wire",
     "forge": lambda h, f: {**h, "handle": _b64(b"x" + bytes(64))}},
    {"name": "short cudaMalloc handle", "level": "wire",
     "forge": lambda h, f: {**h, "handle": _b64(b"\x02c" + bytes(63))}},
    {"name": "unknown handle version", "level": "wire",
     "forge": lambda h, f: {**h, "handle": _b64(b"\x09c" + bytes(64))}},
    {"name": "short event handle that must be synced on", "level": "wire",
     "forge": _with(event_handle=_b64(bytes(8)), event_sync_required=True)},
    {"name": "zero-byte storage", "level": "wire",
     "forge": _with(storage_size_bytes=0, nbytes=0, tensor_offset_bytes=0)},
    {"name": "entry beyond its buffer", "level": "wire", "message": True,
     "forge": lambda h, f: _message({**h, "nbytes": 32}, f)},
    {"name": "two producers in one update", "level": "wire", "message": True,
     "forge": lambda h, f: {**_message(h, f), "buffers": [
         h, {**h, "ref_counter_handle": _b64(b"/torch_1_1_1")}]}},
    {"name": "result slot from another producer", "level": "wire", "message": True,
     "forge": lambda h, f: _message(h, f, results=ResultSlot(BufferHandle.from_json(
         {**h, "ref_counter_handle": _b64(b"/torch_1_1_1"), "nbytes": 48,
          "storage_size_bytes": 48}), 7, 1, 6).to_json())},
    # -- file: refused by the counter-file check, before the open
    {"name": "ref counter file that does not exist", "level": "file",
     "forge": lambda h, f: {**h, "ref_counter_handle": _b64(b"/torch_999999_0_0")}},
    {"name": "ref counter file of the wrong size", "level": "file",
     "forge": lambda h, f: {**h, "ref_counter_handle": _b64(f["small_file"].encode())}},
    {"name": "ref counter name is a symlink to the real file", "level": "file",
     "forge": lambda h, f: {**h, "ref_counter_handle": _b64(f["link_file"].encode())}},
    # -- map: the handle is opened, the declared numbers are checked against it
    {"name": "legit (control)", "level": "map", "expect": "mapped", "sim": True,
     "forge": lambda h, f: h},
    {"name": "storage one byte larger than the allocation", "level": "map", "sim": True,
     "forge": lambda h, f: {**h, "storage_size_bytes": f["alloc_bytes"] + 1}},
    {"name": "storage twice the allocation", "level": "map", "sim": True,
     "forge": lambda h, f: {**h, "storage_size_bytes": 2 * f["alloc_bytes"],
                            "nbytes": 2 * f["alloc_bytes"]}},
    {"name": "storage offset at the end of the allocation", "level": "map", "sim": True,
     "forge": lambda h, f: {**h, "storage_offset_bytes": f["alloc_bytes"]}},
    {"name": "storage offset far out of range", "level": "map", "sim": True,
     "forge": lambda h, f: {**h, "storage_offset_bytes": 1 << 40}},
    {"name": "offset inside, storage running past the end", "level": "map", "sim": True,
     "forge": lambda h, f: {**h, "storage_offset_bytes": f["alloc_bytes"] // 2}},
    # The worker writes its checksum row at tensor_offset: declared inside a storage
    # claimed larger than the allocation, that row would land past its end.
    {"name": "result slot row past the allocation (worker would write)", "level": "map",
     "slot": True, "sim": True,
     "forge": lambda h, f: {**h, "storage_size_bytes": f["alloc_bytes"] + 4096,
                            "tensor_offset_bytes": f["alloc_bytes"] + 1024, "nbytes": 48}},
    {"name": "random cudaMalloc handle", "level": "map",
     "forge": lambda h, f: {**h, "handle": _b64(b"\x02c" + os.urandom(64))}},
    {"name": "in-bounds foreign slot of the producer's own counter file", "level": "map",
     "expect": "either", "slot_probe": True,
     "forge": lambda h, f: {**h, "ref_counter_offset": (h["ref_counter_offset"] + 1)
                            % REF_COUNTER_SLOTS}},
    {"name": "legit expandable segment", "level": "map", "expect": "either",
     "expandable": True, "forge": lambda h, f: h},
]


def _expect(c: dict[str, Any]) -> str:
    return str(c.get("expect", "refused"))


# ------------------------------------------------------------------ attempts


class Opener:
    """Counts how far ``map_buffer`` got: into torch's open, and out of it."""

    def __init__(self) -> None:
        import torch.multiprocessing.reductions as red

        self.red = red
        self.real = red.rebuild_cuda_tensor
        self.entered = 0
        self.returned = 0

    def __call__(self, *a: Any) -> Any:
        self.entered += 1
        t = self.real(*a)
        self.returned += 1
        return t

    @contextlib.contextmanager
    def installed(self) -> Any:
        self.red.rebuild_cuda_tensor = self
        try:
            yield self
        finally:
            self.red.rebuild_cuda_tensor = self.real


def attempt(case: dict[str, Any], body: Any, shm_dir: str, *, gpu: bool,
            opener: Opener | None = None, pattern_check: Callable[[Any], bool] | None = None
            ) -> dict[str, Any]:
    """Drive the receiver on one forged body; say where it stopped."""
    out: dict[str, Any] = {"refused": False, "stage": None, "opened": False, "error": None}
    stage = "wire"
    try:
        if case.get("message"):
            msg = decode_update(body)
            handles = list(msg.buffers)
        elif case.get("slot"):
            slot = ResultSlot(BufferHandle.from_json(body), 1, 1, 6)  # 1 row of 6 cells
            handles = [slot.buffer]
        else:
            handles = [BufferHandle.from_json(body)]
        stage = "ref_counter_file"
        for b in handles:
            check_ref_counter_file(b, shm_dir)
        if not gpu:
            stage = "needs a GPU"
            out["stage"] = stage
            return out
        from rolloutcore.transports.cuda_ipc.loader import map_buffer

        assert opener is not None
        before = opener.entered
        stage = "map"
        t = map_buffer(handles[0], 0, shm_dir=shm_dir)
        out["opened"] = opener.entered > before
        out["mapped_bytes"] = int(t.numel())
        if pattern_check is not None:
            out["pattern_ok"] = pattern_check(t)
        if case.get("slot"):
            out["wrote_slot"] = True  # the engine would write the row here
        del t
        stage = "mapped"
    except BaseException as exc:  # every refusal is recorded, the run goes on
        out["refused"] = True
        out["error"] = f"{type(exc).__name__}: {exc}"[:600]
        out["clear_error"] = isinstance(exc, BadInput)
        if opener is not None and stage == "map":
            out["opened"] = opener.entered > before
            stage = ("mapped_range" if out["opened"] and opener.returned == opener.entered
                     else "cuda_open" if out["opened"] else "ref_counter_file")
    out["stage"] = stage
    return out


def judge(case: dict[str, Any], r: dict[str, Any]) -> bool:
    e = _expect(case)
    if e == "either":
        return True
    if e == "mapped":
        return not r["refused"] and bool(r.get("pattern_ok", True))
    # refused: and never read nor written through a mapping
    return bool(r["refused"]) and not r.get("wrote_slot") and "mapped_bytes" not in r


def run_case(case: dict[str, Any], legit: dict[str, Any], facts: dict[str, Any],
             shm_dir: str, **kw: Any) -> dict[str, Any]:
    """Forge, attempt, judge; a forge the wire already refuses while it is built counts
    as a wire refusal."""
    row: dict[str, Any] = {"name": case["name"], "level": case["level"],
                           "expect": _expect(case), "ran": True}
    t0 = time.monotonic()
    try:
        body = case["forge"](legit, facts)
    except BadInput as exc:
        row.update(refused=True, stage="wire", opened=False, clear_error=True,
                   error=f"{type(exc).__name__}: {exc}"[:600])
    else:
        row.update(attempt(case, body, shm_dir, **kw))
    row["elapsed_s"] = round(time.monotonic() - t0, 4)
    row["as_expected"] = judge(case, row)
    return row


def simulate_range(case: dict[str, Any], legit: dict[str, Any], facts: dict[str, Any]
                   ) -> dict[str, Any]:
    """A "map" case without a GPU: the range check on what the driver would answer for
    the allocation (mapped at a fixed base, of its real size)."""
    row: dict[str, Any] = {"name": case["name"], "level": case["level"],
                           "expect": _expect(case), "ran": True, "opened": False,
                           "simulated": "check_mapped_range with the allocation's size"}
    try:
        body = case["forge"](legit, facts)
        b = BufferHandle.from_json(body)
        if case.get("slot"):
            b = ResultSlot(b, 1, 1, 6).buffer
        base = 0x7F0000000000
        check_mapped_range(b, base + b.storage_offset_bytes, b.storage_size_bytes,
                           base, facts["alloc_bytes"])
        row.update(refused=False, stage="mapped")
    except BadInput as exc:
        row.update(refused=True, stage="mapped_range", error=str(exc)[:600],
                   clear_error=True)
    row["as_expected"] = judge(case, row)
    return row


# ------------------------------------------------------------------ plan mode


def plan() -> dict[str, Any]:
    """Every case that runs without a GPU, on a synthetic handle and counter file."""
    shm = tempfile.mkdtemp(prefix="rc-forged-")
    ref = f"/torch_{os.getpid()}_1_0"
    Path(shm, ref[1:]).write_bytes(bytes(REF_COUNTER_FILE_BYTES))
    small = f"/torch_{os.getpid()}_1_1"
    Path(shm, small[1:]).write_bytes(bytes(80))
    link = f"/torch_{os.getpid()}_1_2"
    os.symlink(Path(shm, ref[1:]), Path(shm, link[1:]))
    legit = BufferHandle(device_uuid=PLAN_UUID, handle=b"\x02c" + bytes(64),
                         storage_size_bytes=BUF_BYTES, storage_offset_bytes=0,
                         ref_counter_handle=ref.encode(), ref_counter_offset=5,
                         event_handle=b"", event_sync_required=False,
                         tensor_offset_bytes=0, nbytes=BUF_BYTES).to_json()
    facts = {"alloc_bytes": BUF_BYTES, "ref_name": ref, "small_file": small,
             "link_file": link}
    cases = []
    for c in CASES:
        if c["level"] in ("wire", "file"):
            cases.append(run_case(c, legit, facts, shm, gpu=False))
        elif c.get("sim"):
            cases.append(simulate_range(c, legit, facts))
        else:
            cases.append({"name": c["name"], "level": c["level"], "expect": _expect(c),
                          "ran": False, "stage": "needs a GPU"})
    for p in (link, small, ref):
        with contextlib.suppress(OSError):
            os.unlink(Path(shm, p[1:]))
    os.rmdir(shm)
    ran = [c for c in cases if c["ran"]]
    return {"mode": "plan", "ok": all(c["as_expected"] for c in ran), "cases": cases,
            "facts": {"ran": len(ran), "not_run": len(cases) - len(ran)}}


# ------------------------------------------------------------------ GPU mode


def _producer(conn: Any, expandable: bool) -> None:
    """A second trainer: shares one buffer (expandable segments when asked), waits."""
    import torch

    from rolloutcore.transports.cuda_ipc.trainer import share_buffer

    torch.cuda.set_device(0)
    buf = torch.empty(BUF_BYTES, dtype=torch.uint8, device="cuda")
    buf.copy_((torch.arange(BUF_BYTES, device="cuda") % 251).to(torch.uint8))
    torch.cuda.synchronize()
    conn.send({"handle": share_buffer(buf).to_json(), "expandable": expandable,
               "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")})
    conn.recv()  # released by the parent
    conn.send({"pattern_ok": bool(torch.equal(
        buf, (torch.arange(BUF_BYTES, device="cuda") % 251).to(torch.uint8)))})


def _consumer(conn: Any) -> None:
    """The engine: every case against the handles it is given."""
    import torch

    torch.cuda.set_device(0)
    torch.cuda.init()
    opener = Opener()
    job = conn.recv()
    facts = job["facts"]
    expect = (torch.arange(4096, device="cuda") % 251).to(torch.uint8)

    def pattern(t: Any) -> bool:
        return bool(torch.equal(t[:4096], expect))

    pid = os.getpid()
    small = f"/torch_{pid}_0_999"
    link = f"/torch_{pid}_0_998"
    Path(SHM_DIR, small[1:]).write_bytes(bytes(80))
    os.symlink(Path(SHM_DIR, facts["ref_name"][1:]), Path(SHM_DIR, link[1:]))
    facts.update(small_file=small, link_file=link)
    rows = []
    with opener.installed():
        for c in CASES:
            h = job["expandable_handle"] if c.get("expandable") else job["handle"]
            if h is None:
                rows.append({"name": c["name"], "level": c["level"], "expect": _expect(c),
                             "ran": False, "error": "no expandable producer"})
                continue
            rows.append(run_case(c, h, facts, SHM_DIR, gpu=True, opener=opener,
                                 pattern_check=pattern))
            torch.cuda.synchronize()
    for p in (small, link):
        with contextlib.suppress(OSError):
            os.unlink(Path(SHM_DIR, p[1:]))
    conn.send(rows)


def _slots(ref_name: str, offset: int) -> dict[str, int] | None:
    p = Path(SHM_DIR, ref_name.lstrip("/"))
    try:
        data = p.read_bytes()
    except OSError:
        return None
    out = {}
    for o in (offset, (offset + 1) % REF_COUNTER_SLOTS):
        at = REF_COUNTER_FILE_BYTES - 8 * REF_COUNTER_SLOTS + 8 * o  # after the header
        out[str(o)] = int.from_bytes(data[at:at + 8], "little", signed=True)
    return out


def gpu() -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    from rolloutcore.transports.cuda_ipc.trainer import share_buffer

    torch.cuda.set_device(0)
    buf = torch.empty(BUF_BYTES, dtype=torch.uint8, device="cuda")
    buf.copy_((torch.arange(BUF_BYTES, device="cuda") % 251).to(torch.uint8))
    torch.cuda.synchronize()
    h = share_buffer(buf)
    hj = h.to_json()
    ctx = mp.get_context("spawn")
    # The expandable-segments producer: its allocator config must be set before it
    # initializes CUDA, so it goes in its environment at spawn.
    e_parent, e_child = ctx.Pipe()
    old = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    ep = ctx.Process(target=_producer, args=(e_child, True), daemon=True)
    ep.start()
    if old is None:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF")
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = old
    e_info = e_parent.recv() if e_parent.poll(120) else None
    slots_before = _slots(h.ref_counter_handle.decode(), h.ref_counter_offset)
    facts = {"alloc_bytes": BUF_BYTES, "ref_name": h.ref_counter_handle.decode(),
             "ref_offset": h.ref_counter_offset, "handle_kind": chr(handle_kind(h.handle)[0]),
             "handle_len": len(h.handle),
             "ref_file_bytes": os.path.getsize(Path(SHM_DIR, h.ref_counter_handle.decode()[1:]))
             if Path(SHM_DIR, h.ref_counter_handle.decode()[1:]).exists() else None}
    if e_info is not None:
        eh = e_info["handle"]
        facts["expandable_handle_kind"] = chr(handle_kind(BufferHandle.from_json(eh).handle)[0])
        facts["expandable_handle_len"] = len(BufferHandle.from_json(eh).handle)
    parent, child = ctx.Pipe()
    cp = ctx.Process(target=_consumer, args=(child,), daemon=True)
    cp.start()
    parent.send({"handle": hj, "expandable_handle": e_info and e_info["handle"],
                 "facts": dict(facts)})
    rows = parent.recv() if parent.poll(300) else [{"name": "consumer", "ran": True,
                                                     "as_expected": False,
                                                     "error": "no answer in 300 s"}]
    cp.join(60)
    torch.cuda.synchronize()
    pattern_ok = bool(torch.equal(buf, (torch.arange(BUF_BYTES, device="cuda") % 251)
                                  .to(torch.uint8)))
    facts["slots_before"] = slots_before
    facts["slots_after"] = _slots(h.ref_counter_handle.decode(), h.ref_counter_offset)
    facts["producer_buffer_intact"] = pattern_ok
    if e_info is not None:
        e_parent.send(None)
        e_res = e_parent.recv() if e_parent.poll(60) else None
        facts["expandable_producer_buffer_intact"] = e_res and e_res["pattern_ok"]
        ep.join(30)
    ran = [r for r in rows if r.get("ran")]
    ok = pattern_ok and all(r.get("as_expected") for r in ran)
    return {"mode": "gpu", "ok": ok, "cases": rows, "facts": facts,
            "device": torch.cuda.get_device_name(0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plan", action="store_true", help="no GPU: run what runs without one")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        rep = plan() if args.plan else gpu()
    except BaseException:
        rep = {"mode": "plan" if args.plan else "gpu", "ok": False, "cases": [],
               "error": traceback.format_exc()}
    import torch

    rep["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                       "cuda": torch.version.cuda}
    rep["elapsed_s"] = round(time.monotonic() - t0, 2)
    (args.out / "forged-handles.json").write_text(json.dumps(rep, indent=1) + "\n")
    for c in rep["cases"]:
        mark = "-" if not c.get("ran") else ("ok" if c.get("as_expected") else "FAIL")
        print(f"{mark:4} {c['name']}: {c.get('stage')} {(c.get('error') or '')[:120]}")
    print(f"ok={rep['ok']} ({rep['elapsed_s']} s) -> {args.out / 'forged-handles.json'}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
