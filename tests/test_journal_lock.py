"""One writer per journal (#47, symptom 8): a second opener is refused while another holds it.

Two gateways given one ``--journal`` numbered the same ``seq`` twice and the
next restart refused the file ("sequence gap"). The journal now holds the
file's ``flock`` while open: the holder here is a real second process (a
gateway's is no different: ``open_controller`` opens a ``Journal``), and one
killed -9 leaves no lock behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.fault_matrix import PromiseRows
from rolloutcore.control.journal import Journal, open_controller, read_journal
from rolloutcore.core.records import Note
from rolloutcore.errors import JournalError

MATRIX = PromiseRows("tests/test_journal_lock.py",
                     engines="none (the journal on a real file, a second real process)",
                     engine="none")
_fault_matrix = MATRIX.fixture()

_HOLDER = textwrap.dedent("""
    import sys, time
    from rolloutcore.control.journal import Journal
    from rolloutcore.core.records import Note
    j = Journal(sys.argv[1])
    j.write(Note("holder", {}))
    j.sync()
    print("held", flush=True)
    time.sleep(600)
""")


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [src, *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A second process holding ``tmp_path/journal.jsonl`` open as its journal."""
    path = tmp_path / "journal.jsonl"
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], env=_env(),
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        yield p, path
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
        if p.stdout is not None:
            p.stdout.close()


def test_a_second_process_cannot_open_a_held_journal(
        holder: tuple[subprocess.Popen[str], Path]) -> None:
    proc, path = holder
    size = path.stat().st_size
    with pytest.raises(JournalError, match=rf"already being written by process {proc.pid}"):
        Journal(path)
    with pytest.raises(JournalError, match="one writer per journal"):
        open_controller(path)
    # Refused before touching anything: the holder's file is as it wrote it.
    assert path.stat().st_size == size
    assert [r.seq for r in read_journal(path)] == [1]
    # A holder killed -9 leaves no lock: the next gateway opens and continues the file.
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    j = Journal(path)
    try:
        j.write(Note("next", {}))
        j.sync()
    finally:
        j.close()
    assert [r.seq for r in read_journal(path)] == [1, 2]
    MATRIX.row("journal_second_writer",
               "a second process opens the journal a live writer holds; then the holder "
               "is killed -9",
               "refused (JournalError naming the holder's pid), the file untouched; after "
               "the kill the next writer opens it and continues at seq 2",
               "the holder's state unchanged", published_unvalidated=0, records_lost=0)


def test_a_second_journal_in_this_process_is_refused_until_the_first_closes(
        tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    first = Journal(path)
    first.write(Note("first", {}))
    with pytest.raises(JournalError, match="already being written by this process"):
        Journal(path)
    first.close()
    second = Journal(path)
    try:
        assert second.write(Note("second", {})).seq == 2
    finally:
        second.close()


def test_reading_a_held_journal_is_allowed(holder: tuple[subprocess.Popen[str], Path]) -> None:
    """The audit and ``status`` read a journal a gateway writes: only writers are refused."""
    _, path = holder
    assert [r.kind for r in read_journal(path, live=True)] == ["note"]
