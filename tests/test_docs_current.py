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
