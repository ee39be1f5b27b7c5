"""``serve`` on real models (#48): vLLM's engine options pass through, RolloutCore's are
refused with the reason, the tiny defaults apply to the tiny checkpoint only, and a taken
port is found before anything starts (exit status 4)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rolloutcore.cli import build_parser, main
from rolloutcore.engine.args import (
    OWNED,
    TINY_MARKER,
    check_vllm_args,
    engine_defaults,
    flag_value,
)
from rolloutcore.engine.process import ManagedEngine
from rolloutcore.errors import BadInput

pytest.importorskip("httpx")   # serve's options need the service extra to run


def _model(tmp_path: Path, *, tiny: bool) -> Path:
    d = tmp_path / ("tiny" if tiny else "real")
    d.mkdir()
    (d / "config.json").write_text("{}")
    if tiny:
        (d / TINY_MARKER).write_text("{}")
    return d


def test_tiny_defaults_apply_to_the_tiny_checkpoint_only(tmp_path: Path) -> None:
    tiny, real = _model(tmp_path, tiny=True), _model(tmp_path, tiny=False)
    cmd = ManagedEngine(tiny, port=18000).command()
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--max-model-len") + 1] == "512"
    cmd = ManagedEngine(real, port=18000).command()
    assert "--dtype" not in cmd and "--max-model-len" not in cmd   # vLLM's own defaults
    # The user's options win over the tiny defaults, in either spelling, and once.
    e = ManagedEngine(tiny, port=18000, extra_args=["--max-model-len=1024", "--dtype",
                                                    "float32", "--enforce-eager"])
    cmd = e.command()
    assert cmd.count("--dtype") == 1 and cmd[cmd.index("--dtype") + 1] == "float32"
    assert "--max-model-len" not in cmd and "--max-model-len=1024" in cmd
    assert cmd[-4:] == ["--max-model-len=1024", "--dtype", "float32", "--enforce-eager"]
    assert (e.dtype, e.max_model_len) == ("float32", 1024)   # what a recorder reports
    assert engine_defaults(real, None, None, ()) == (None, None)
    assert flag_value(["--x", "1", "--x=2"], "--x") == "2"


@pytest.mark.parametrize("opt", ["--port=9000", "--host", "--weight-transfer-config={}",
                                 "--worker-extension-cls=a.B", "--middleware=m.f",
                                 "--tensor-parallel-size=2", "--enable-lora",
                                 "--served-model-name=x"])
def test_an_owned_option_is_refused_with_the_reason(
        opt: str, capsys: pytest.CaptureFixture[str]) -> None:
    name = opt.split("=")[0]
    with pytest.raises(BadInput, match=f"vLLM option {name} is RolloutCore's"):
        check_vllm_args([opt])
    # Through the CLI: exit 2, the reason first, before anything starts.
    assert main(["serve", "--model", "/nonexistent", f"--vllm-arg={opt}"]) == 2
    err = capsys.readouterr().err.splitlines()[0]
    assert f"vLLM option {name} is RolloutCore's on a launched engine: {OWNED[name]}" in err


def test_passthrough_spellings_reach_the_serve_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, ...]] = []
    import rolloutcore.service.serve as serve

    monkeypatch.setattr(serve, "run_serve", lambda o: seen.append(o.vllm_args) or 0)
    assert main(["serve", "--vllm-arg=--max-model-len=4096", "--vllm-arg=--enforce-eager",
                 "--", "--gpu-memory-utilization", "0.5"]) == 0
    assert seen == [("--max-model-len=4096", "--enforce-eager",
                     "--gpu-memory-utilization", "0.5")]
    with pytest.raises(SystemExit) as exc:   # '--' is serve's only
        main(["audit", "--trajectories", "t", "--", "--x"])
    assert exc.value.code == 2


def test_engine_options_are_refused_for_a_running_engine() -> None:
    with pytest.raises(BadInput, match="keeps the options it was started with"):
        check_vllm_args(["--enforce-eager"], launched=False)
    assert main(["serve", "--upstream", "http://127.0.0.1:9", "--checkpoint", "/x",
                 "--vllm-arg=--enforce-eager"]) == 2


def test_a_taken_port_is_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ManagedEngine, "start", lambda self, *a, **k: pytest.fail("started"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        work = tmp_path / "w"
        assert main(["serve", "--port", str(port), "--workdir", str(work)]) == 4
        assert main(["serve", "--engines", "2", "--port", str(port),
                     "--workdir", str(work)]) == 4
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"rolloutcore serve: error: port {port} on 127.0.0.1 is not "
                             "free")
    assert "nothing started" in err[0] and not work.exists()


def test_serve_help_documents_the_passthrough() -> None:
    sub = build_parser("serve")._subparsers._group_actions[0]   # type: ignore[union-attr]
    text = sub.choices["serve"].format_help()  # type: ignore[attr-defined]
    assert "--vllm-arg" in text and "refused" in text


def test_a_fleet_s_engines_take_the_same_passthrough() -> None:
    from rolloutcore.cli.serve import fleet_options

    parse = build_parser("serve").parse_args
    args = parse(["serve", "--engines", "2", "--vllm-arg=--enforce-eager"])
    assert fleet_options(args).vllm_args == ("--enforce-eager",)
    with pytest.raises(BadInput, match="vLLM option --port is RolloutCore's"):
        fleet_options(parse(["serve", "--engines", "2", "--vllm-arg=--port=1"]))
