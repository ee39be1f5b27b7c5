from pathlib import Path

from rolloutcore.core.tables import render


def test_state_machine_doc_is_generated_from_the_tables() -> None:
    doc = Path(__file__).parent.parent / "docs" / "state-machine.md"
    assert doc.read_text() == render(), (
        "run: python -m rolloutcore.core.tables > docs/state-machine.md")
