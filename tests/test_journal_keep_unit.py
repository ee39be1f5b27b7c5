"""A journal's in-memory records are bounded on request; its file keeps everything."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutcore.control.journal import Journal, read_journal
from rolloutcore.core.records import Note
from rolloutcore.errors import JournalError


def test_keep_bounds_memory_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    j = Journal(path, keep=3)
    for i in range(10):
        j.write(Note("n", {"i": i}))
    assert [r.data["i"] for r in j.records] == [7, 8, 9]
    j.close()
    assert [r.data["i"] for r in read_journal(path)] == list(range(10))
    assert [r.seq for r in read_journal(path)] == list(range(1, 11))
    unbounded = Journal()
    for i in range(5):
        unbounded.write(Note("n", {"i": i}))
    assert len(unbounded.records) == 5
    none = Journal(keep=0)
    none.write(Note("n"))
    assert none.records == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_keep_must_be_a_count(bad: object) -> None:
    with pytest.raises(JournalError, match="keep"):
        Journal(keep=bad)  # type: ignore[arg-type]
