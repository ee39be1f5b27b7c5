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


def test_each_rank_of_each_engine_gets_cores_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet of tensor-parallel engines: ``n * ranks`` disjoint core groups, one per rank,
    ``|`` between an engine's ranks (vLLM's form); too few cores refused, naming the count."""
    from rolloutcore.fleet.placement import cpu_binding

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    eight = list(range(8))
    assert [cpu_binding(i, 2, ranks=2, cpus=eight)["VLLM_CPU_OMP_THREADS_BIND"]
            for i in range(2)] == ["0-1|2-3", "4-5|6-7"]
    assert [cpu_binding(i, 4, ranks=2, cpus=eight)["VLLM_CPU_OMP_THREADS_BIND"]
            for i in range(4)] == ["0|1", "2|3", "4|5", "6|7"]
    assert cpu_binding(0, 1, ranks=2, cpus=[0, 2, 4, 6]) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0,2|4,6"}
    # Every core used at most once across the fleet.
    got = [cpu_binding(i, 3, ranks=2, cpus=eight)["VLLM_CPU_OMP_THREADS_BIND"]
           for i in range(3)]
    cores = [c for g in got for r in g.split("|") for c in r.split(",")]
    assert len(cores) == len(set(cores)) == 6
    with pytest.raises(BadInput, match=r"2 engine\(s\) of 2 ranks .* need 4 CPU cores.* 2 \(0,1\)"):
        cpu_binding(0, 2, ranks=2, cpus=[0, 1])
    # The operator's own binding (sharing cores knowingly) is left alone.
    assert cpu_binding(0, 2, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, ranks=2, cpus=[0, 1]) == {}
    with pytest.raises(BadInput, match="ranks"):
        cpu_binding(0, 2, ranks=0, cpus=eight)


def test_launch_local_refuses_too_few_cores_before_starting_anything(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rolloutcore.engine import process
    from rolloutcore.fleet.placement import launch_local

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    started: list[object] = []
    monkeypatch.setattr(process.ManagedEngine, "start", lambda self: started.append(self))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BadInput, match="need 4 CPU cores"):
        launch_local(2, tmp_path, tensor_parallel_size=2)
    with pytest.raises(BadInput, match="pipeline_parallel_size"):
        launch_local(2, tmp_path, pipeline_parallel_size=0)
    assert started == []


def test_a_fleet_of_sharded_engines_is_local_not_ray() -> None:
    o = FleetServeOptions(engines=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (o.tensor_parallel_size, o.pipeline_parallel_size) == (2, 2)
    with pytest.raises(BadInput, match="--ray places one-rank engines"):
        FleetServeOptions(engines=2, ray=True, tensor_parallel_size=2)
    with pytest.raises(BadInput, match="tensor_parallel_size"):
        FleetServeOptions(engines=2, tensor_parallel_size=0)


def test_engines_crowding_a_host_keep_vllms_idle_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shorter spin put answers over 5 s under load (results/idle-spin.json): nothing
    sets it; an engine on a crowded host gets its own cores only."""
    from rolloutcore.fleet.placement import cpu_binding

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cpu_binding(1, 3) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert cpu_binding(0, 1) == {}


@pytest.mark.parametrize("flag,value,needle", [
    ("--checkpoint", "/tmp", "--checkpoint with a fleet"),
    ("--engine-url", "http://127.0.0.1:9", "--engine-url with a fleet"),
    ("--lease-s", "30", "--lease-s with a fleet"),
    ("--transport-backend", "rc_cuda_ipc", "--transport-backend with a fleet"),
])
def test_options_a_fleet_does_not_take_are_refused_with_the_reason(
        flag: str, value: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--engines", "2", flag, value]) == 2
    err = capsys.readouterr().err
    assert needle in err and ":" in err.split(needle, 1)[1]


def test_every_other_serve_option_reaches_the_fleet(tmp_path: Path) -> None:
    """No option is accepted and dropped: each ``serve`` option is refused for a fleet
    (``FLEET_REFUSED``) or arrives in ``FleetServeOptions``."""
    import argparse

    from rolloutcore.cli import serve as cli_serve

    p = argparse.ArgumentParser()
    cli_serve.add_arguments(p)
    probe = tmp_path / "probe.json"
    probe.write_text("{}")
    args = p.parse_args([
        "--engines", "2", "--record", str(tmp_path / "t.jsonl"), "--min-verification",
        "manifest", "--drain-policy", "refuse", "--drain-timeout-s", "7",
        "--max-body-bytes", "4096", "--client-body-s", "3", "--client-send-s", "4",
        "--takeover-probe", str(probe), "--journal", str(tmp_path / "j"),
        "--health-interval-s", "0", "--queue", "5", "--queue-wait-s", "6",
        "--data-token", "d" * 20, "--token", "t" * 20, "--token-out", str(tmp_path / "tok")])
    o = cli_serve.fleet_options(args)
    assert (o.record, o.min_verification, o.drain_policy, o.drain_timeout_s,
            o.max_body_bytes, o.client_body_s, o.client_send_s, o.takeover_probe,
            o.journal_dir, o.health_interval_s, o.queue, o.queue_wait_s) == (
        str(tmp_path / "t.jsonl"), "manifest", "refuse", 7.0, 4096, 3.0, 4.0, str(probe),
        str(tmp_path / "j"), 0.0, 5, 6.0)
    taken = {a.dest for a in p._actions} - {"help", "func"}
    import dataclasses

    from rolloutcore.fleet.serve import FleetServeOptions

    fields = {f.name for f in dataclasses.fields(FleetServeOptions)}
    renamed = {"journal": "journal_dir"}
    missing = sorted(d for d in taken if renamed.get(d, d) not in fields
                     and d not in cli_serve.FLEET_REFUSED)
    assert missing == []


def test_a_non_loopback_fleet_needs_both_tokens_and_is_allowed_with_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rolloutcore.fleet.serve import _check

    monkeypatch.delenv("ROLLOUTCORE_DATA_TOKEN", raising=False)
    monkeypatch.delenv("ROLLOUTCORE_TOKEN", raising=False)
    with pytest.raises(BadInput, match=r"data token|data plane"):
        _check(FleetServeOptions(host="0.0.0.0", token="t" * 20))
    got = _check(FleetServeOptions(host="0.0.0.0", token="t" * 20, data_token="d" * 20))
    assert got[1] is True and got[2].data_token == "d" * 20


def test_a_native_round_on_a_fleet_is_bounded_by_lease_s() -> None:
    """``--lease-s`` reaches the fleet's gateway config (a native round is expired after
    it, as on one engine), clamped as one engine's is; without --native-routes it bounds
    nothing and is refused."""
    from rolloutcore.fleet.serve import _check

    tok = "t" * 20
    assert _check(FleetServeOptions(native_routes=True, lease_s=7.5, token=tok))[2].lease_s == 7.5
    assert _check(FleetServeOptions(native_routes=True, lease_s=9e9, token=tok))[2].lease_s \
        == 1800.0
    with pytest.raises(BadInput, match="--lease-s with a fleet: it bounds a round"):
        FleetServeOptions(lease_s=30.0)
    for bad in (0, -1.0, True, "30", float("nan"), float("inf")):
        with pytest.raises(BadInput, match="lease_s"):
            FleetServeOptions(native_routes=True, lease_s=bad)  # type: ignore[arg-type]


def test_a_fleet_journal_of_another_fleet_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    """An existing journal is restored (``tests/test_fleet_restore.py``); one that cannot
    be (not a fleet's, other replicas) is refused at start, not appended to blind."""
    from rolloutcore.fleet.serve import _check

    (tmp_path / "fleet.jsonl").write_text("")  # empty: a new fleet
    _check(FleetServeOptions(journal_dir=str(tmp_path), token="t" * 20))
    (tmp_path / "fleet.jsonl").write_text(
        '{"seq": 1, "t_mono": 0.0, "t_wall": 0.0, "kind": "note", "schema": 4, '
        '"data": {"what": "x", "detail": {}}}\n')
    with pytest.raises(BadInput, match="cannot restore"):
        _check(FleetServeOptions(journal_dir=str(tmp_path), token="t" * 20))


def test_native_routes_reach_a_fleet_and_lora_beside_them_is_refused() -> None:
    import argparse

    from rolloutcore.cli import serve as cli_serve
    from rolloutcore.errors import BadInput
    from rolloutcore.fleet.serve import FleetServeOptions

    p = argparse.ArgumentParser()
    cli_serve.add_arguments(p)
    o = cli_serve.fleet_options(p.parse_args(["--engines", "2", "--native-routes"]))
    assert o.native_routes is True and o.engines == 2
    with pytest.raises(BadInput, match="native-routes with --lora"):
        FleetServeOptions(engines=2, native_routes=True, lora=True)
    with pytest.raises(BadInput, match="native_routes must be a bool"):
        FleetServeOptions(engines=2, native_routes="yes")  # type: ignore[arg-type]
