from pathlib import Path

import pytest

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


# --------------------------------------------------------------------------- #48: the CLI docs

ROOT = Path(__file__).parent.parent
#: The README's first lines, exactly: the setup + main job, and the tests.
README_HEAD = (
    "# RolloutCore\n\n```bash\n"
    "./scripts/setup.sh && .venv/bin/rolloutcore train   # set up, then a GRPO training (TRL) "
    "through RolloutCore on a real vLLM\n"
    "./scripts/test.sh                                    # lint, types, fast tests, "
    "real-engine tests\n```\n")


def test_the_cli_reference_is_generated_from_the_parsers() -> None:
    from rolloutcore.cli.reference import render

    assert (ROOT / "docs" / "cli.md").read_text() == render(), (
        "run: python -m rolloutcore.cli.reference > docs/cli.md")


def test_the_readme_first_screen() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith(README_HEAD)
    first = readme.split("<!-- end of the first screen", 1)[0]
    assert first != readme and first.count("\n") <= 60, first.count("\n")
    # what it is, the transition, three ways in, each one click from the README
    for needed in ("control plane for RL rollouts served by vLLM", "DRAIN", "PUBLISH",
                   "**try it**", "**my TRL script**", "**my own vLLM and trainer**",
                   "(docs/quickstart.md#my-trl-script)", "(docs/own-vllm.md)",
                   "(docs/troubleshooting.md)", "(docs/cli.md)", "(docs/measured.md)"):
        assert needed in first, needed
    assert "\n## My TRL script\n" in (ROOT / "docs" / "quickstart.md").read_text()
    assert "rollout_func=rollout" in (ROOT / "docs" / "quickstart.md").read_text()
    # the long measured table lives in docs/, linked
    assert "| hot verified transition vs restart |" in (ROOT / "docs" / "measured.md").read_text()
    assert "| hot verified transition vs restart |" not in readme
    assert max(len(line) for line in first.splitlines()) <= 300


def test_troubleshooting_names_every_exit_status() -> None:
    from rolloutcore.service.serve import PORT_IN_USE, TAKEOVER_REFUSED

    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    for status in (0, 1, 2, TAKEOVER_REFUSED, PORT_IN_USE, 130):
        assert f"\n| {status} |" in doc, status
    for said in ("is a lifecycle journal, not a trajectory file", "holds no committed sample",
                 "is not a lifecycle journal", "NOT VERIFIED", "is not free",
                 "is RolloutCore's on a launched engine", "without a weight-transfer backend",
                 "vLLM exited with status", "VLLM_CPU_KVCACHE_SPACE"):
        assert said in doc, said


def _doc_commands() -> list[tuple[str, str, list[str]]]:
    """Every ``rolloutcore`` command line of a ```bash block in README.md and docs/:
    (file, line, the arguments after ``rolloutcore``). ``[...]`` marks an optional part
    and is read as given; a shell operator or a comment ends the command."""
    import re
    import shlex

    out = []
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"```(?:bash|sh|shell|console)\n(.*?)```", f.read_text(), re.S):
            for line in m.group(1).replace("\\\n", " ").splitlines():
                toks = [t.strip("[]") for t in shlex.split(line, comments=True)]
                toks = [t for t in toks if t]
                at = next((i for i, t in enumerate(toks)
                           if t == "rolloutcore" or t.endswith("/rolloutcore")), None)
                if at is None:
                    continue
                args = toks[at + 1:]
                ends = [i for i, t in enumerate(args) if t in ("&", "&&", "|", "||", ";", ">")]
                out.append((f.name, line.strip(), args[:ends[0]] if ends else args))
    return out


def test_every_command_example_in_the_docs_parses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Each example's options are accepted by its parser (``--help``-level); the cheap
    ones run (the demo, on the simulated engine)."""
    from rolloutcore.cli import build_parser, main

    examples = _doc_commands()
    assert len(examples) >= 15, examples
    monkeypatch.chdir(tmp_path)
    ran = 0
    for name, line, args in examples:
        head = args[:args.index("--")] if "--" in args else args
        command = next((a for a in head if not a.startswith("-")), None)
        try:
            parser = build_parser(command)
        except Exception as exc:  # an extra that is not installed here
            pytest.skip(f"{line}: {exc}")
        try:
            parser.parse_args(head)
        except SystemExit:
            pytest.fail(f"{name}: `{line}` is not accepted by `rolloutcore {command}`:\n"
                        f"{capsys.readouterr().err}")
        if command == "demo":
            assert main([*args, "--token-delay-ms", "0"]) == 0, line
            ran += 1
    assert ran >= 1
