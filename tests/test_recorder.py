"""Recorder: one group = one transaction, recovery, idempotence, locking, cursor.

The crash tests run a real writer process (tests/helpers/traj_writer.py) and
SIGKILL it while a group is half on disk.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.trajtools import make_group
from rolloutcore.errors import BadInput, JournalError
from rolloutcore.provenance import recorder as recorder_mod
from rolloutcore.provenance.recorder import (
    AppendOutcome,
    GenerationCursor,
    TrajectoryRecorder,
    read_groups,
    read_trajectories,
)
from rolloutcore.provenance.trajectory import SCHEMA_VERSION, TrajectoryGroup, group_id_for

WRITER = Path(__file__).parent / "helpers" / "traj_writer.py"


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WRITER), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(proc: subprocess.Popen[str], marker: str, timeout_s: float = 30.0) -> list[str]:
    """Lines printed until ``marker`` (inclusive); fails if the process ends first."""
    assert proc.stdout is not None
    lines: list[str] = []
    done = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                lines.append(line.strip())
                if line.strip() == marker:
                    return
        except (OSError, ValueError):
            pass
        finally:
            done.set()

    threading.Thread(target=pump, daemon=True).start()
    if not done.wait(timeout_s) or marker not in lines:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"writer never printed {marker!r}; out={lines} err={err}")
    return lines


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


# --------------------------------------------------------------------------- basics

def test_append_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    groups = [make_group(prompt_index=i, n=3) for i in range(3)]
    with TrajectoryRecorder(path) as rec:
        assert rec.recovery.clean
        for g in groups:
            assert rec.append_group(g) is AppendOutcome.COMMITTED
        assert list(rec.committed_groups()) == [g.group_id for g in groups]
        assert rec.is_committed(groups[1].group_id)
    assert list(read_groups(path)) == groups
    samples = list(read_trajectories(path))
    assert samples == [s for g in groups for s in g.samples]
    # The file is n sample lines + 1 commit line per group, all canonical JSON.
    lines = path.read_bytes().splitlines()
    assert len(lines) == 3 * (3 + 1)
    commit = json.loads(lines[3])
    # A text-only group is written as schema version 1, as before version 2 (media).
    assert commit["record"] == "commit" and commit["schema_version"] == 1
    assert commit["content_digest"] == groups[0].content_digest


def test_reopen_keeps_index(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    g = make_group(prompt_index=0)
    with TrajectoryRecorder(path) as rec:
        rec.append_group(g)
    with TrajectoryRecorder(path) as rec:
        assert rec.recovery.clean
        assert rec.committed_groups()[g.group_id].content_digest == g.content_digest
        assert rec.append_group(make_group(prompt_index=1)) is AppendOutcome.COMMITTED
    assert [x.prompt_index for x in read_groups(path)] == [0, 1]


def test_idempotent_reappend_is_a_noop(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    g = make_group(prompt_index=0, t0=1000.0)
    with TrajectoryRecorder(path) as rec:
        rec.append_group(g)
        size = path.stat().st_size
        assert rec.append_group(g) is AppendOutcome.ALREADY_COMMITTED
        # An equal group built again (same content, new objects) is the same group.
        assert rec.append_group(make_group(prompt_index=0, t0=1000.0)) \
            is AppendOutcome.ALREADY_COMMITTED
        assert path.stat().st_size == size
    with TrajectoryRecorder(path) as rec:  # also after a restart
        assert rec.append_group(g) is AppendOutcome.ALREADY_COMMITTED
    assert path.stat().st_size == size
    assert len(list(read_groups(path))) == 1


def test_different_group_under_same_id_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TrajectoryRecorder(path) as rec:
        rec.append_group(make_group(prompt_index=0, t0=1000.0))
        before = path.read_bytes()
        other = make_group(prompt_index=0, t0=2000.0)  # same id, other timestamps
        with pytest.raises(BadInput, match="already committed with different content"):
            rec.append_group(other)
        other_n = make_group(prompt_index=0, n=2, t0=1000.0)
        with pytest.raises(BadInput, match="already committed"):
            rec.append_group(other_n)
        assert path.read_bytes() == before
        # The recorder is still usable.
        assert rec.append_group(make_group(prompt_index=1)) is AppendOutcome.COMMITTED


def test_append_rejects_non_groups(tmp_path: Path) -> None:
    with TrajectoryRecorder(tmp_path / "t.jsonl") as rec:
        with pytest.raises(BadInput, match="TrajectoryGroup"):
            rec.append_group(make_group().samples)  # type: ignore[arg-type]
        assert (tmp_path / "t.jsonl").stat().st_size == 0


def test_closed_recorder_refuses(tmp_path: Path) -> None:
    rec = TrajectoryRecorder(tmp_path / "t.jsonl")
    rec.close()
    rec.close()  # idempotent
    with pytest.raises(JournalError, match="closed"):
        rec.append_group(make_group())


def test_bad_path_and_timeout(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="directory"):
        TrajectoryRecorder(tmp_path)
    with pytest.raises(BadInput, match="lock_timeout_s"):
        TrajectoryRecorder(tmp_path / "t.jsonl", lock_timeout_s=-1)
    with pytest.raises(BadInput, match="does not exist"):
        list(read_groups(tmp_path / "missing.jsonl"))
    with pytest.raises(BadInput, match="does not exist"):
        TrajectoryRecorder(tmp_path / "no-such-dir" / "t.jsonl")


# --------------------------------------------------------------------------- locking

def test_second_writer_is_locked_out(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TrajectoryRecorder(path) as rec:
        t = time.monotonic()
        with pytest.raises(JournalError, match="locked by another writer"):
            TrajectoryRecorder(path, lock_timeout_s=0.2)
        assert time.monotonic() - t >= 0.2
        rec.append_group(make_group())
    # Released on close: a later writer gets in.
    with TrajectoryRecorder(path) as rec:
        assert len(rec.committed_groups()) == 1


def test_lock_waits_for_release(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    first = TrajectoryRecorder(path)
    threading.Timer(0.2, first.close).start()
    with TrajectoryRecorder(path, lock_timeout_s=10) as rec:
        assert rec.recovery.clean


def test_concurrent_appends_from_threads(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    groups = [make_group(prompt_index=i, n=2) for i in range(24)]
    outcomes: list[AppendOutcome] = []
    with TrajectoryRecorder(path) as rec:
        def work(k: int) -> None:
            for g in groups[k::4] + groups[:2]:  # every thread also re-appends 0 and 1
                outcomes.append(rec.append_group(g))
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert outcomes.count(AppendOutcome.COMMITTED) == 24
    assert outcomes.count(AppendOutcome.ALREADY_COMMITTED) == 8
    assert sorted(g.prompt_index for g in read_groups(path)) == list(range(24))


# --------------------------------------------------------------------------- recovery

@pytest.mark.parametrize("cut", ["half", "before-commit", "commit-no-newline"])
def test_crash_mid_group_leaves_no_partial_group(tmp_path: Path, cut: str) -> None:
    path = tmp_path / "t.jsonl"
    proc = _spawn("crash-append", str(path), cut)
    try:
        _wait_for(proc, "STALLED")
        # While the writer lives it holds the lock, across processes.
        with pytest.raises(JournalError, match="locked"):
            TrajectoryRecorder(path)
    finally:
        _kill(proc)
    committed = make_group(prompt_index=0)  # same content as the writer's group 0
    raw = path.read_bytes()
    first_group_bytes = raw.index(b'"record":"commit"')
    end0 = raw.index(b"\n", first_group_bytes) + 1
    assert len(raw) > end0, "the writer left no partial group: the test proves nothing"
    # Readers never see the partial group, even before recovery.
    groups = list(read_groups(path))
    assert [g.group_id for g in groups] == [committed.group_id]
    assert groups[0].samples[0].completion == committed.samples[0].completion
    with TrajectoryRecorder(path) as rec:
        assert not rec.recovery.clean
        assert rec.recovery.truncated_bytes == len(raw) - end0
        assert rec.recovery.torn_line == (cut != "before-commit")
        assert rec.recovery.dropped_group_ids == (group_id_for("run-a", 3, 1),)
        assert path.stat().st_size == end0
        assert list(rec.committed_groups()) == [committed.group_id]
        # The next append works and lands on a clean boundary.
        again = make_group(prompt_index=1)
        assert rec.append_group(again) is AppendOutcome.COMMITTED
    assert [g.prompt_index for g in read_groups(path)] == [0, 1]
    with TrajectoryRecorder(path) as rec:
        assert rec.recovery.clean


def test_every_torn_prefix_recovers_to_the_last_commit(tmp_path: Path) -> None:
    src = tmp_path / "src.jsonl"
    with TrajectoryRecorder(src) as rec:
        rec.append_group(make_group(prompt_index=0, n=2))
        rec.append_group(make_group(prompt_index=1, n=2))
    raw = src.read_bytes()
    end0 = raw.index(b"\n", raw.index(b'"record":"commit"')) + 1
    path = tmp_path / "t.jsonl"
    # Every line boundary of group 1, one byte short of the end, and a sweep in between.
    boundaries = {i + 1 for i in range(end0, len(raw) - 1) if raw[i] == ord("\n")}
    for cut in sorted({*range(end0, len(raw), 37), *boundaries, len(raw) - 1}):
        path.write_bytes(raw[:cut])
        assert [g.prompt_index for g in read_groups(path)] == [0], cut
        with TrajectoryRecorder(path) as rec:
            assert rec.recovery.truncated_bytes == cut - end0
        assert path.read_bytes() == raw[:end0]
    path.write_bytes(raw)
    assert [g.prompt_index for g in read_groups(path)] == [0, 1]


def test_failed_write_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    with TrajectoryRecorder(path) as rec:
        rec.append_group(make_group(prompt_index=0))
        size = path.stat().st_size

        def disk_full(fd: int, data: bytes) -> None:
            os.write(fd, data[: len(data) // 3])
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(recorder_mod, "_write_all", disk_full)
        with pytest.raises(JournalError, match="No space left"):
            rec.append_group(make_group(prompt_index=1))
        assert path.stat().st_size == size
        assert not rec.is_committed(group_id_for("run-a", 3, 1))
        monkeypatch.undo()
        assert rec.append_group(make_group(prompt_index=1)) is AppendOutcome.COMMITTED
    assert [g.prompt_index for g in read_groups(path)] == [0, 1]


def test_damage_before_committed_data_is_refused_not_truncated(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TrajectoryRecorder(path) as rec:
        for i in range(3):
            rec.append_group(make_group(prompt_index=i, n=2))
    raw = bytearray(path.read_bytes())
    pos = raw.index(b"\n", raw.index(b'"record":"commit"')) + 20  # inside group 1
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(JournalError, match="refusing to drop committed data"):
        list(read_groups(path))
    with pytest.raises(JournalError, match="refusing to drop committed data"):
        TrajectoryRecorder(path)
    assert path.read_bytes() == bytes(raw)


@pytest.mark.parametrize("junk", [b"not json\n", b"SAMPLE\n"])
def test_stray_lines_between_committed_groups_are_refused(tmp_path: Path, junk: bytes) -> None:
    path = tmp_path / "t.jsonl"
    with TrajectoryRecorder(path) as rec:
        for i in range(2):
            rec.append_group(make_group(prompt_index=i, n=2))
    raw = path.read_bytes()
    end0 = raw.index(b"\n", raw.index(b'"record":"commit"')) + 1
    if junk == b"SAMPLE\n":  # a complete sample line of a group that never committed
        junk = make_group(prompt_index=7, n=2).samples[0].encode()
    path.write_bytes(raw[:end0] + junk + raw[end0:])
    with pytest.raises(JournalError, match="line 4 is damaged"):
        list(read_groups(path))
    with pytest.raises(JournalError, match="refusing to drop committed data"):
        TrajectoryRecorder(path)


def test_foreign_file_is_not_truncated(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    content = b'{"seq": 1, "kind": "commit", "data": {}}\n{"seq": 2}\n'
    path.write_bytes(content)
    assert list(read_groups(path)) == []
    with pytest.raises(JournalError, match="not a RolloutCore trajectory record"):
        TrajectoryRecorder(path)
    assert path.read_bytes() == content


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 0])
def test_unknown_schema_version_in_file(tmp_path: Path, version: int) -> None:
    path = tmp_path / "t.jsonl"
    with TrajectoryRecorder(path) as rec:
        rec.append_group(make_group(prompt_index=0))
    line = json.loads(path.read_bytes().splitlines()[0])
    line["schema_version"] = version
    with path.open("ab") as f:
        f.write(json.dumps(line).encode() + b"\n")
    word = "newer" if version > SCHEMA_VERSION else "unknown"
    with pytest.raises(BadInput, match=f"{word}.*schema_version {version}|schema_version "
                                       f"{version}.*{word}"):
        list(read_groups(path))
    with pytest.raises(BadInput, match=f"schema_version {version}"):
        TrajectoryRecorder(path)


def test_same_prompt_under_another_group_id_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    g = make_group(prompt_index=0)
    with TrajectoryRecorder(path) as rec:
        rec.append_group(g)
        samples = [dataclasses.replace(s, group_id="other-id") for s in g.samples]
        with pytest.raises(BadInput, match="already committed as group"):
            rec.append_group(TrajectoryGroup(tuple(samples)))


# --------------------------------------------------------------------------- cursor

def test_cursor_compacts_and_lists_pending() -> None:
    c = GenerationCursor("run-a", 3)
    assert c.pending(4) == [0, 1, 2, 3]
    c = c.advance(2).advance(0)
    assert (c.next_prompt_index, c.committed_ahead) == (1, (2,))
    assert c.pending(5) == [1, 3, 4]
    c = c.advance(1)
    assert (c.next_prompt_index, c.committed_ahead) == (3, ())
    assert c.advance(1) is c
    assert c.committed_indices() == [0, 1, 2]
    with pytest.raises(BadInput):
        c.advance(-1)
    with pytest.raises(BadInput):
        GenerationCursor("run-a", 3, 5, (2,))
    with pytest.raises(BadInput):
        c.pending(-1)


def test_cursor_save_load_roundtrip(tmp_path: Path) -> None:
    p = tmp_path / "cursor.json"
    assert GenerationCursor.load(p) is None
    c = GenerationCursor("run-a", 3).advance(0).advance(4)
    c.save(p)
    assert GenerationCursor.load(p) == c
    assert [x.name for x in tmp_path.iterdir()] == ["cursor.json"]  # no temp file left
    p.write_text('{"cursor_version": 99}')
    with pytest.raises(BadInput, match="cursor_version 99"):
        GenerationCursor.load(p)
    p.write_text("{not json")
    with pytest.raises(BadInput, match="not JSON"):
        GenerationCursor.load(p)


def test_cursor_behind_the_file_is_reconciled_ahead_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TrajectoryRecorder(path) as rec:
        for i in (0, 1, 3):
            rec.append_group(make_group(prompt_index=i))
        file_cursor = rec.cursor("run-a", 3)
        assert file_cursor.pending(5) == [2, 4]
        assert rec.cursor("run-a", 4).pending(2) == [0, 1]
        behind = GenerationCursor("run-a", 3).advance(0)
        assert behind.reconcile(rec) == file_cursor
        ahead = file_cursor.advance(2)
        with pytest.raises(JournalError, match=r"prompts \[2\] are committed"):
            ahead.reconcile(rec)


def test_generator_resumes_across_kills_without_skip_or_dup(tmp_path: Path) -> None:
    path, cursor = tmp_path / "t.jsonl", tmp_path / "cursor.json"
    total = 8

    # 1. Killed while prompt 2's group is half written.
    p = _spawn("generate", str(path), str(cursor), str(total), "--stall-at", "2",
               "--stall-kind", "mid-write")
    try:
        out = _wait_for(p, "STALLED")
    finally:
        _kill(p)
    assert out == ["RESUME [0, 1, 2, 3, 4, 5, 6, 7]", "COMMITTED 0", "COMMITTED 1", "STALLED"]

    # 2. Resumes at 2; killed after committing 4 but before saving the cursor.
    p = _spawn("generate", str(path), str(cursor), str(total), "--stall-at", "4",
               "--stall-kind", "after-commit")
    try:
        out = _wait_for(p, "STALLED")
    finally:
        _kill(p)
    assert out == ["RESUME [2, 3, 4, 5, 6, 7]", "COMMITTED 2", "COMMITTED 3", "STALLED"]
    assert GenerationCursor.load(cursor) == GenerationCursor("run-a", 3, 4)  # behind the file

    # 3. Resumes at 5 (4 is in the file though not in the cursor) and finishes.
    p = _spawn("generate", str(path), str(cursor), str(total))
    out_s, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out_s.split("\n")[0] == "RESUME [5, 6, 7]"

    groups = list(read_groups(path))
    assert [g.prompt_index for g in groups] == list(range(total))
    assert [g.group_id for g in groups] == [group_id_for("run-a", 3, i) for i in range(total)]
    assert all(len(g) == 4 for g in groups)
    assert GenerationCursor.load(cursor) == GenerationCursor("run-a", 3, total)
    with TrajectoryRecorder(path) as rec:
        assert rec.recovery.clean
        assert rec.cursor("run-a", 3).pending(total) == []
