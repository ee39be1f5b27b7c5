"""A real writer process for the recorder crash tests; the test SIGKILLs it.

    traj_writer.py crash-append PATH CUT
        commit group 0, then write group 1 only up to CUT (``half``: half of
        its bytes, ``before-commit``: all sample lines but no commit marker,
        ``commit-no-newline``: everything but the final newline), fsync, print
        ``STALLED`` and wait to be killed.

    traj_writer.py generate PATH CURSOR TOTAL [--stall-at K --stall-kind KIND]
        a generator: resume from the file (and the saved cursor), generate the
        pending prompts of run-a/step 3 in order, commit each group, save the
        cursor, print ``COMMITTED i``. With ``--stall-at K`` it stalls on
        prompt K, either ``mid-write`` (half the group's bytes written) or
        ``after-commit`` (group committed, cursor not saved yet).

The stall replaces ``rolloutcore.provenance.recorder._write_all`` from here, so the
library carries no test hook.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from trajtools import make_group

from rolloutcore.provenance import recorder
from rolloutcore.provenance.recorder import GenerationCursor, TrajectoryRecorder

RUN, STEP, N = "run-a", 3, 4


def _stall() -> None:
    print("STALLED", flush=True)
    time.sleep(120)
    sys.exit(3)  # not killed: the test failed to kill us


def _cutting_writer(cut: str) -> Callable[[int, bytes], None]:
    def write(fd: int, data: bytes) -> None:
        if cut == "half":
            n = len(data) // 2
        elif cut == "before-commit":
            n = data.rstrip(b"\n").rfind(b"\n") + 1
        elif cut == "commit-no-newline":
            n = len(data) - 1
        else:
            raise SystemExit(f"unknown cut {cut}")
        os.write(fd, data[:n])
        os.fsync(fd)
        _stall()
    return write


def crash_append(path: str, cut: str) -> None:
    with TrajectoryRecorder(path) as rec:
        rec.append_group(make_group(prompt_index=0, n=N))
        recorder._write_all = _cutting_writer(cut)
        rec.append_group(make_group(prompt_index=1, n=N))


def generate(path: str, cursor_path: str, total: int, stall_at: int | None,
             stall_kind: str) -> None:
    with TrajectoryRecorder(path, lock_timeout_s=5.0) as rec:
        saved = GenerationCursor.load(cursor_path)
        cursor = saved.reconcile(rec) if saved is not None else rec.cursor(RUN, STEP)
        print(f"RESUME {cursor.pending(total)}", flush=True)
        for i in cursor.pending(total):
            if i == stall_at and stall_kind == "mid-write":
                recorder._write_all = _cutting_writer("half")
            rec.append_group(make_group(run=RUN, step=STEP, prompt_index=i, n=N))
            if i == stall_at and stall_kind == "after-commit":
                _stall()
            cursor = cursor.advance(i)
            cursor.save(cursor_path)
            print(f"COMMITTED {i}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("crash-append")
    a.add_argument("path")
    a.add_argument("cut")
    g = sub.add_parser("generate")
    g.add_argument("path")
    g.add_argument("cursor")
    g.add_argument("total", type=int)
    g.add_argument("--stall-at", type=int, default=None)
    g.add_argument("--stall-kind", default="mid-write")
    args = ap.parse_args()
    if args.cmd == "crash-append":
        crash_append(args.path, args.cut)
    else:
        generate(args.path, args.cursor, args.total, args.stall_at, args.stall_kind)


if __name__ == "__main__":
    main()
