"""One option vocabulary (#48): every option has help, every default shows in --help,
``--json`` prints JSON, ``--report PATH`` writes it, the trajectory file and the journal
have one name each, and the old spellings still work with a one-line warning."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rolloutcore import __version__
from rolloutcore.cli import COMMANDS, build_parser, main


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every subcommand's parser (and ``model make``), with its options loaded."""
    for cmd in COMMANDS:
        try:
            parser = build_parser(cmd.name)
        except Exception as exc:  # an extra that is not installed here
            pytest.skip(f"{cmd.name}: {exc}")
        todo = [(cmd.name, parser._subparsers._group_actions[0].choices[cmd.name])]  # type: ignore[union-attr]
        while todo:
            name, p = todo.pop()
            yield name, p
            for a in p._actions:
                if isinstance(a, argparse._SubParsersAction):
                    todo += [(f"{name} {n}", sp) for n, sp in a.choices.items()]


def test_every_option_has_help_and_shows_its_default() -> None:
    seen = 0
    for name, p in _parsers():
        p.format_help()   # every help string formats
        fmt = p._get_formatter()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help and a.help.strip(), f"{name} {a.option_strings or a.dest}: no help"
            seen += 1
            if a.option_strings and a.default not in (None, False, [], (), argparse.SUPPRESS):
                # the default is in the help text, written by hand or appended
                shown = fmt._get_help_string(a) or ""
                assert "default" in shown, f"{name} {a.option_strings[0]}: {shown}"
    assert seen > 60


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"rolloutcore {__version__}"


def test_json_prints_and_report_writes(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    fast = ["demo", "--tokens", "4", "--token-delay-ms", "0"]
    assert main([*fast, "--json", "--report", str(tmp_path / "r.json"),
                 "--journal", str(tmp_path / "j.jsonl")]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)   # stdout is the JSON, and only it
    assert doc["published"] == "rc-1" and cap.err == ""
    assert json.loads((tmp_path / "r.json").read_text()) == doc
    assert (tmp_path / "j.jsonl").read_text().count("\n") > 5


def test_old_spellings_warn_once_and_still_work(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    journal = tmp_path / "old.jsonl"
    assert main(["demo", "--tokens", "4", "--token-delay-ms", "0", "--json",
                 str(journal)]) == 0
    cap = capsys.readouterr()
    assert journal.exists() and "state timeline" in cap.out   # the text, as before
    assert cap.err.splitlines() == [
        f"rolloutcore: warning: --json {journal} is deprecated: use --journal {journal} "
        "(it does the same)"]
    pytest.importorskip("httpx")
    args = build_parser("serve").parse_args(["serve", "--record", "t.jsonl"])
    assert args.record == "t.jsonl"
    assert "--record is deprecated: use --trajectories" in capsys.readouterr().err
    args = build_parser("serve").parse_args(["serve", "--trajectories", "t.jsonl"])
    assert args.record == "t.jsonl" and capsys.readouterr().err == ""
    for verb in ("train", "live-update"):
        args = build_parser(verb).parse_args([verb, "--json", "r.json"])
        assert args.report == "r.json" and args.json is False
        assert "use --report r.json" in capsys.readouterr().err
        assert build_parser(verb).parse_args([verb, "--json"]).json is True


def test_the_trajectory_file_is_positional_or_an_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "t.jsonl")
    for argv in (["audit", missing], ["audit", "--trajectories", missing]):
        assert main(argv) == 2
        assert "does not exist" in capsys.readouterr().err
    assert main(["audit"]) == 2
    assert "give the trajectory file" in capsys.readouterr().err
    assert main(["audit", missing, "--trajectories", "other"]) == 2
    assert "two trajectory files" in capsys.readouterr().err


def test_live_update_logs_under_its_workdir_and_says_where_on_failure(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("httpx")
    import rolloutcore.testing.models as models
    from rolloutcore.errors import EngineUnavailable
    from rolloutcore.session import EngineSession

    seen: dict[str, object] = {}

    def fake_launch(*a: object, **kw: object) -> None:
        seen.update(kw)
        raise EngineUnavailable("launch", "vLLM exited", mutation_started=False)

    monkeypatch.setattr(models, "make_checkpoint", lambda d, seed: Path(d).mkdir(parents=True))
    monkeypatch.setattr(EngineSession, "launch", fake_launch)
    work = tmp_path / "w"
    assert main(["live-update", "--workdir", str(work), "--quiet"]) == 2
    assert seen["engine_kwargs"] == {"log_dir": work / "logs"}
    err = capsys.readouterr().err
    assert f"the engine's log is in {work / 'logs'}" in err.splitlines()[0]
