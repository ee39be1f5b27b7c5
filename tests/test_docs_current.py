from pathlib import Path

from rolloutcore.core.tables import render


def test_state_machine_doc_is_generated_from_the_tables() -> None:
    doc = Path(__file__).parent.parent / "docs" / "state-machine.md"
    assert doc.read_text() == render(), (
        "run: python -m rolloutcore.core.tables > docs/state-machine.md")


def test_every_journal_record_kind_is_documented() -> None:
    from rolloutcore.core.records import KINDS, SCHEMA_VERSION

    doc = (Path(__file__).parent.parent / "docs" / "journal-schema.md").read_text()
    assert f"schema version {SCHEMA_VERSION}" in doc
    missing = sorted(k for k in KINDS if f"| `{k}` |" not in doc)
    assert missing == [], f"docs/journal-schema.md lacks {missing}"


def test_the_fault_matrix_doc_shows_the_rows_of_the_json() -> None:
    """Each ``table`` command in docs/fault-matrix.md is followed by what it prints."""
    import shlex

    from helpers.fault_matrix import tables_command

    root = Path(__file__).parent.parent
    doc = (root / "docs" / "fault-matrix.md").read_text()
    marker = "tests/engine/test_faults_engine.py table "
    commands = [line for line in doc.splitlines() if marker in line]
    assert len(commands) >= 4, commands
    pos = 0
    for line in commands:
        pos = doc.index(line, pos) + len(line)
        args = shlex.split(line.split(marker, 1)[1])
        expected = tables_command([str(root / args[0]), *args[1:]])
        start = doc.index("\n|", pos) + 1
        assert doc[start:start + len(expected) + 1] == expected + "\n", (
            f"docs/fault-matrix.md: the table after `{line.strip()}` is not what it prints "
            "from results/fault-matrix.json: run it and paste its output there")


def test_every_test_the_vllm_versions_page_names_exists() -> None:
    """docs/vllm-versions.md says which test shows each difference handled: each exists."""
    import re

    root = Path(__file__).parent.parent
    doc = (root / "docs" / "vllm-versions.md").read_text()
    named = set(re.findall(r"`(?:[\w/]+\.py::)?(test_\w+)(?:\[\w+\])?`", doc))
    assert len(named) >= 6, named
    defined = {m for f in (root / "tests").rglob("test_*.py")
               for m in re.findall(r"^(?:async )?def (test_\w+)", f.read_text(), re.M)}
    assert sorted(named - defined) == []
