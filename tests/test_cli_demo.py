"""The demo end to end, as a subprocess (also with nothing installed), and the CLI's errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutcore.cli import COMMANDS, main
from rolloutcore.control.journal import first_index, read_journal
from rolloutcore.core.invariants import check_journal


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rolloutcore.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_demo_subprocess_writes_journal(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    p = _cli("demo", "--tokens", "40", "--token-delay-ms", "5", "--json", str(path))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "DRAINING" in out and "VALIDATING" in out and "published: rc-1" in out
    assert "complete(R-long) before begin_update: True" in out
    recs = read_journal(path)
    assert check_journal(recs) == []
    i_done = first_index(recs, "complete", rollout_id="R-long")
    i_begin = first_index(recs, "begin_update")
    assert 0 <= i_done < i_begin
    long_admit = recs[first_index(recs, "admit", rollout_id="R-long")]
    assert long_admit.data["version"]["label"] == "default"
    commit = [r for r in recs if r.kind == "commit"][-1]
    assert commit.data["identity"]["verification"] == "probe"
    for line in path.read_text().splitlines():
        json.loads(line)


def test_bad_arguments_exit_nonzero_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    """In process (the console script is ``main``; the subprocess tests here run it
    through ``python -m``): a process per case was most of this test's time."""
    for args in (["demo", "--tokens", "0"], ["demo", "--tokens", "x"],
                 ["demo", "--token-delay-ms", "-1"], ["nonsense"], []):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 2, args
        assert "error" in capsys.readouterr().err, args


def test_demo_unwritable_journal_is_a_clear_error(tmp_path: Path) -> None:
    p = _cli("demo", "--json", str(tmp_path / "no" / "such" / "dir" / "j.jsonl"))
    assert p.returncode == 2
    assert "cannot open journal" in p.stderr


# --------------------------------------------------------------------------- no install

SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh venv with nothing installed: not pip, not httpx, not torch."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True, timeout=120)
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import httpx"], capture_output=True, text=True,
                           timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert probe.returncode != 0, "the bare venv can import httpx: not bare"
    return py


def _bare(py: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """As the README says: ``PYTHONPATH=src python -m ...``, from another directory."""
    return subprocess.run([py, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(SRC)})


@pytest.mark.parametrize("entry", ["rolloutcore", "rolloutcore.cli"])
def test_demo_needs_no_dependency(bare_python: str, tmp_path: Path, entry: str) -> None:
    p = _bare(bare_python, tmp_path, "-m", entry, "demo", "--tokens", "24",
              "--token-delay-ms", "2", "--json", "j.jsonl")
    assert p.returncode == 0, p.stderr
    assert "published: rc-1" in p.stdout
    assert "complete(R-long) before begin_update: True" in p.stdout
    assert check_journal(read_journal(tmp_path / "j.jsonl")) == []


def test_help_lists_every_subcommand_without_importing_them(bare_python: str,
                                                            tmp_path: Path) -> None:
    p = _bare(bare_python, tmp_path, "-m", "rolloutcore", "--help")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())   # argparse wraps the help lines
    for cmd in COMMANDS:
        assert f"{cmd.name} {cmd.help}" in text
    p = _bare(bare_python, tmp_path, "-m", "rolloutcore", "serve", "--help")
    assert p.returncode == 0 and "--upstream" in p.stdout, p.stderr


@pytest.mark.parametrize("args,extra", [
    (["replay", "--trajectories", "t.jsonl", "--engine", "http://127.0.0.1:9"], "service"),
    (["serve", "--upstream", "http://127.0.0.1:9", "--checkpoint", "x"], "service"),
    (["model", "make", "--out", "m", "--seed", "1"], "cpu"),
])
def test_a_missing_extra_is_named(bare_python: str, tmp_path: Path, args: list[str],
                                  extra: str) -> None:
    p = _bare(bare_python, tmp_path, "-m", "rolloutcore", *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    assert f"pip install 'rolloutcore[{extra}]'" in p.stderr and "needs the" in p.stderr
    assert not (tmp_path / "m").exists()


def test_every_verbs_help_works_with_nothing_installed(bare_python: str,
                                                       tmp_path: Path) -> None:
    """#29: ``--help`` of every verb with nothing installed (``replay --help`` said it
    needed httpx); running one that needs an extra still names it (above)."""
    # One bare process asks every verb in turn (a process each was most of this test's
    # time): an import a verb's help needs fails there as it would alone.
    script = ("import contextlib, io, json, sys\n"
              "from rolloutcore.cli import COMMANDS, main\n"
              "out = {}\n"
              "for cmd in COMMANDS:\n"
              "    buf = io.StringIO()\n"
              "    try:\n"
              "        with contextlib.redirect_stdout(buf):\n"
              "            rc = main([cmd.name, '--help'])\n"
              "    except SystemExit as exc:\n"
              "        rc = exc.code\n"
              "    except BaseException as exc:\n"
              "        rc = repr(exc)\n"
              "    out[cmd.name] = [rc, buf.getvalue()]\n"
              "print(json.dumps(out))\n")
    p = _bare(bare_python, tmp_path, "-c", script)
    assert p.returncode == 0, p.stderr[-2000:]
    helps = json.loads(p.stdout.splitlines()[-1])
    assert set(helps) == {cmd.name for cmd in COMMANDS}
    for name, (rc, text) in helps.items():
        assert rc == 0, (name, rc, p.stderr[-500:])
        assert "usage:" in text, name
