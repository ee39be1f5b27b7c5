"""``rolloutcore serve --engines N`` / ``--ray``: bad input refused before any engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutcore.cli import main
from rolloutcore.core.pool import Strategy
from rolloutcore.errors import BadInput
from rolloutcore.fleet.serve import FleetServeOptions, parse_update_request


@pytest.mark.parametrize("argv", [["serve", "--engines", "0"],
                                  ["serve", "--engines", "two"]])
def test_bad_engine_counts_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--engines", "2", "--default-policy", "newest"], "unknown routing policy"),
    (["serve", "--engines", "2", "--quorum", "3"], "quorum must be in 1..2"),
    (["serve", "--engines", "3", "--min-serving", "3"], "min_serving must be in 0..2"),
    (["serve", "--engines", "2", "--upstream", "http://127.0.0.1:9"], "--upstream"),
    (["serve", "--engines", "2", "--model", "/nonexistent"], "not a model directory"),
    (["serve", "--engines", "2", "--host", "0.0.0.0"], "without a control token"),
])
def test_bad_fleet_options_exit_2_before_anything_starts(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUTCORE_TOKEN", raising=False)
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_options_checked_on_construction() -> None:
    for kw in ({"engines": 0}, {"engines": True}, {"port": 0}, {"default_policy": "pinned:"},
               {"engines": 2, "quorum": 0}):
        with pytest.raises(BadInput):
            FleetServeOptions(**kw)  # type: ignore[arg-type]
    assert FleetServeOptions(engines=3, min_serving=2).min_serving == 2


def test_update_requests_are_checked_field_by_field(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    got = parse_update_request({"checkpoint": str(ck), "strategy": "rolling", "min_serving": 1})
    assert got["strategy"] is Strategy.ROLLING and got["min_serving"] == 1
    for body, needle in (({"checkpoint": "/nope"}, "model directory"),
                         ({"checkpoint": str(ck), "strategy": "x"}, "strategy"),
                         ({"checkpoint": str(ck), "quorum": -1}, "quorum"),
                         ({"checkpoint": str(ck), "label": 3}, "label"),
                         ({"checkpoint": str(ck), "transfer": "mail"}, "transfer"),
                         ({"checkpoint": str(ck), "colour": "red"}, "unknown fields")):
        with pytest.raises(BadInput, match=needle):
            parse_update_request(body)


def test_engines_on_one_host_get_their_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from rolloutcore.fleet.placement import cpu_binding

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cpu_binding(0, 1) == {}
    assert [cpu_binding(i, 2) for i in range(2)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    assert [cpu_binding(i, 3)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(3)] == ["0", "1", "0"]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {2, 3, 4, 5}, raising=False)
    assert [cpu_binding(i, 2)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(2)] == ["2,3", "4,5"]
    assert cpu_binding(0, 2, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == {}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert cpu_binding(1, 2) == {}


def test_engines_crowding_a_host_are_told_not_to_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    from rolloutcore.fleet.placement import idle_spin, shared_host_env
    from rolloutcore.transports.vllm_plugin import IDLE_SPIN_ENV

    monkeypatch.delenv(IDLE_SPIN_ENV, raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert idle_spin(1) == {}                       # one engine: vLLM's default
    assert idle_spin(2) == {IDLE_SPIN_ENV: "0.1"}     # 2 engines, 2 cores: crowded
    assert shared_host_env(1, 3) == {"VLLM_CPU_OMP_THREADS_BIND": "1", IDLE_SPIN_ENV: "0.1"}
    assert idle_spin(2, {IDLE_SPIN_ENV: "0.5"}) == {}   # the caller chose
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert idle_spin(8) == {}                       # two cores per engine: room to spin
    assert idle_spin(9) == {IDLE_SPIN_ENV: "0.1"}
    monkeypatch.setenv(IDLE_SPIN_ENV, "1")
    assert idle_spin(9) == {}
