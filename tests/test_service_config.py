"""Settings, tokens and the ``serve`` command's refusals (nothing is launched)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rolloutcore.cli import build_parser
from rolloutcore.cli import main as cli_main
from rolloutcore.cli.serve import options
from rolloutcore.errors import BadInput
from rolloutcore.service.auth import check_bearer, generate_token, read_token_file
from rolloutcore.service.config import ServiceConfig, check_bind, is_loopback
from rolloutcore.service.serve import ServeOptions, run_serve

TOK = "t" * 20


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.3.4.5", True),
                                        ("::1", True), ("[::1]", True), ("localhost", True),
                                        ("0.0.0.0", False), ("10.0.0.1", False),
                                        ("example.org", False), ("::", False)])
def test_loopback_detection(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


def test_non_loopback_bind_needs_a_given_token() -> None:
    check_bind("127.0.0.1", False)
    check_bind("0.0.0.0", True, True)  # both tokens given (the data token: #16)
    with pytest.raises(BadInput, match="without a control token"):
        check_bind("0.0.0.0", False)
    with pytest.raises(BadInput):
        check_bind("", True)


@pytest.mark.parametrize("kw", [
    {"upstream_url": "ftp://x"}, {"upstream_url": "127.0.0.1:8000"},
    {"control_token": "short"}, {"control_token": "has a space in it 123"},
    {"data_token": "short"}, {"max_body_bytes": 0}, {"max_body_bytes": True},
    {"queue_max": -1}, {"queue_wait_s": 0}, {"lease_s": float("inf")},
    {"lease_s": 100, "max_lease_s": 10}, {"upstream_read_s": -1}, {"history": 0},
    {"transport": ["backend"]}, {"engine_url": "nope"},
    {"health_interval_s": -1}, {"health_interval_s": float("nan")},
    {"health_timeout_s": 0}, {"health_failures": 0}, {"health_failures": 1.5},
])
def test_bad_settings_fail_at_construction(kw: dict[str, Any]) -> None:
    base: dict[str, Any] = {"upstream_url": "http://127.0.0.1:8000", "control_token": TOK}
    with pytest.raises(BadInput):
        ServiceConfig(**{**base, **kw})


def test_good_settings() -> None:
    c = ServiceConfig(upstream_url="http://127.0.0.1:8000/", control_token=TOK,
                      transport={"backend": "x"})
    assert c.upstream_url == "http://127.0.0.1:8000"
    assert c.advertised_engine_url == c.upstream_url
    assert ServiceConfig(upstream_url="http://a:1", control_token=TOK,
                         engine_url="http://b:2").advertised_engine_url == "http://b:2"
    assert ServiceConfig(upstream_url="http://a:1", control_token=TOK,
                         health_interval_s=0).health_interval_s == 0  # watch off


def test_bearer_checks() -> None:
    tok = generate_token()
    assert len(tok) >= 40 and tok != generate_token()
    assert check_bearer(None, None).ok
    assert check_bearer(None, tok).status == 401
    assert check_bearer(f"Bearer {tok}", tok).ok
    assert check_bearer(f"bearer   {tok}  ".encode(), tok).ok
    assert check_bearer(f"Bearer {tok[:-1]}", tok).status == 403
    assert check_bearer(f"Token {tok}", tok).status == 401
    assert check_bearer("Bearer ", tok).status == 401
    assert check_bearer("Bearer \u00e9\u00e9", tok).status == 403


def test_token_file(tmp_path: Path) -> None:
    p = tmp_path / "tok"
    p.write_text(f"  {TOK}  \nignored\n")
    assert read_token_file(p) == TOK
    p.write_text("\n")
    with pytest.raises(BadInput):
        read_token_file(p)
    with pytest.raises(BadInput):
        read_token_file(tmp_path / "missing")


def _args(*argv: str) -> ServeOptions:
    opts: ServeOptions = options(build_parser("serve").parse_args(["serve", *argv]))
    return opts


def test_serve_refuses_before_launching_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUTCORE_TOKEN", raising=False)
    with pytest.raises(BadInput, match="without a control token"):
        run_serve(_args("--host", "0.0.0.0"))
    with pytest.raises(BadInput, match="--checkpoint"):
        run_serve(_args("--upstream", "http://127.0.0.1:9"))
    with pytest.raises(BadInput, match="not both"):
        run_serve(_args("--token", TOK, "--token-file", "/x"))
    with pytest.raises(BadInput, match="at least 16"):
        run_serve(_args("--token", "short", "--upstream", "http://127.0.0.1:9",
                        "--checkpoint", "/x"))
    assert cli_main(["serve", "--host", "0.0.0.0"]) == 2
    with pytest.raises(SystemExit):
        _args("--port", "70000")
    with pytest.raises(SystemExit):
        _args("--upstream", "http://a:1", "--model", "/m")


def test_serve_options_refuse_bad_values_without_the_cli() -> None:
    """``run_serve`` is a library entry point: its options check themselves."""
    for bad in ({"port": 0}, {"port": 70000}, {"port": True}, {"step": -1},
                {"queue": 1.5}, {"max_body_bytes": -1}, {"transport_backend": ""},
                {"drain_timeout_s": 0}, {"drain_timeout_s": float("inf")},
                {"upstream": "http://a:1", "model": "/m"}):
        with pytest.raises(BadInput):
            ServeOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="ServeOptions"):
        run_serve(_args().__dict__)  # type: ignore[arg-type]
    assert _args("--port", "9000", "--queue", "3") == ServeOptions(port=9000, queue=3)


def test_a_worker_extension_is_for_a_launched_engine_only(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--worker-extension-cls`` goes to the engine ``serve --model`` launches; a running
    engine (``--upstream``) keeps its own, and a name that is not one is refused."""
    assert _args("--worker-extension-cls", "pkg.mod.Ext").worker_extension_cls == "pkg.mod.Ext"
    assert _args().worker_extension_cls is None
    for bad in ({"worker_extension_cls": ""}, {"worker_extension_cls": "a b"},
                {"worker_extension_cls": 3},
                {"worker_extension_cls": "a.B", "upstream": "http://a:1"}):
        with pytest.raises(BadInput, match="worker_extension_cls"):
            ServeOptions(**bad)  # type: ignore[arg-type]
    assert cli_main(["serve", "--engines", "2", "--worker-extension-cls", "a.B"]) == 2
    assert "--worker-extension-cls with a fleet" in capsys.readouterr().err


def test_pipeline_stages_are_for_a_launched_engine_only(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert _args("--pipeline-parallel-size", "2").pipeline_parallel_size == 2
    assert _args().pipeline_parallel_size == 1
    for bad in ({"pipeline_parallel_size": 0}, {"pipeline_parallel_size": True},
                {"pipeline_parallel_size": 65},
                {"pipeline_parallel_size": 2, "upstream": "http://a:1"}):
        with pytest.raises(BadInput, match="pipeline_parallel_size"):
            ServeOptions(**bad)  # type: ignore[arg-type]
    # A fleet of PP engines: each rank of each engine on cores of its own, or refused
    # before anything is made (here: a 2-core host, four ranks).
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli_main(["serve", "--engines", "2", "--pipeline-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "need 4 CPU cores" in err and "generated" not in err
    assert cli_main(["serve", "--ray", "--pipeline-parallel-size", "2"]) == 2
    assert "--ray places one-rank engines" in capsys.readouterr().err
