"""``rolloutcore serve --lora`` (one engine and a fleet) and the client's adapter calls:
bad input refused before anything starts or is sent."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolloutcore.cli import main
from rolloutcore.core.versions import Provenance
from rolloutcore.errors import BadInput, UpdateFailed, UpdateRefused
from rolloutcore.service.client import RolloutCoreClient
from rolloutcore.service.serve import ServeOptions, lora_engine_args


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--max-loras", "2"], "without it they are refused"),
    (["serve", "--max-lora-rank", "8"], "without it they are refused"),
    (["serve", "--lora", "--max-lora-rank", "12"], "max_lora_rank must be one of"),
    (["serve", "--lora", "--max-loras", "65"], "max_loras must be an int in 1..64"),
    (["serve", "--lora", "--upstream", "http://127.0.0.1:9", "--checkpoint", "/x"],
     "give model instead"),
    (["serve", "--engines", "2", "--lora", "--max-lora-rank", "3"], "max_lora_rank"),
    (["serve", "--engines", "2", "--max-loras", "2"], "without it they are refused"),
])
def test_bad_lora_options_exit_2_before_anything_starts(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUTCORE_TOKEN", raising=False)
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "--lora", "--max-loras", "0"],
                                  ["serve", "--lora", "--max-lora-rank", "x"]])
def test_non_numbers_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2


def test_lora_options_reach_the_engine_and_the_fleet(tmp_path: Path) -> None:
    from rolloutcore.cli import serve as cli_serve

    p = argparse.ArgumentParser()
    cli_serve.add_arguments(p)
    args = p.parse_args(["--lora", "--max-loras", "3", "--max-lora-rank", "32"])
    o = cli_serve.options(args)
    assert (o.lora, o.max_loras, o.max_lora_rank) == (True, 3, 32)
    fo = cli_serve.fleet_options(p.parse_args(["--engines", "2", "--lora", "--max-loras",
                                               "4"]))
    assert (fo.lora, fo.max_loras, fo.max_lora_rank) == (True, 4, None)
    eargs, env, budget = lora_engine_args(3, 32)
    assert eargs == ("--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                     "--max-cpu-loras", "3", "--middleware",
                     "rolloutcore.transports.adapter_store.AdapterStore")
    # A Ray fleet may sit on other nodes: its adapters are uploaded (options accepted).
    fo = cli_serve.fleet_options(p.parse_args(["--engines", "2", "--ray", "--lora"]))
    assert fo.ray and fo.lora
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert budget.max_loaded == 3 and budget.max_staleness == 1
    # The defaults: 2 in a batch, rank 16, three loaded (current, one kept, the next).
    assert lora_engine_args(None, None)[0][2:7:2] == ("2", "16", "3")
    for kw in ({"lora": 1}, {"lora": True, "max_loras": True},
               {"lora": True, "max_lora_rank": 7}):
        with pytest.raises(BadInput):
            ServeOptions(**kw)  # type: ignore[arg-type]


class _Gateway:
    """A gateway's /control/adapters answers, recorded (the client's side only)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status, self.body = status, body
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return httpx.Response(self.status, json=self.body)


def _client(gw: _Gateway) -> RolloutCoreClient:
    return RolloutCoreClient("http://gw.test", "t" * 20,
                             http_transport=httpx.MockTransport(gw))


def test_client_refuses_bad_input_before_sending(tmp_path: Path) -> None:
    gw = _Gateway(200, {})
    c = _client(gw)
    (tmp_path / "empty").mkdir()
    prov = Provenance("ck", "run", 1)
    for bad in (tmp_path / "empty", tmp_path / "missing", "", 3, True):
        with pytest.raises(BadInput):
            c.update_adapter(bad, prov)  # type: ignore[arg-type]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    with pytest.raises(BadInput, match="provenance"):
        c.update_adapter(tmp_path / "a", {"checkpoint": "x"})  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="timeout_s"):
        c.update_adapter(tmp_path / "a", prov, timeout_s=0)
    for tol in (0, -1, 0.06, True, "0.01", float("nan")):
        with pytest.raises(BadInput, match="probe_tolerance"):
            c.update_adapter(tmp_path / "a", prov, probe_tolerance=tol)  # type: ignore[arg-type]
    assert gw.requests == []


def test_the_adapter_bodys_probe_tolerance_is_checked_field_by_field(tmp_path: Path) -> None:
    from rolloutcore.service.adapter_control import adapter_probe_tolerance, parse_adapter_body

    body: dict[str, Any] = {"adapter_dir": str(tmp_path), "provenance": {"checkpoint": "c"}}
    assert adapter_probe_tolerance(body) is None
    assert adapter_probe_tolerance({**body, "probe_tolerance": 0.05}) == 0.05
    parse_adapter_body({**body, "probe_tolerance": 0.02})
    for bad in (0, 0.051, "x", None, True, [0.01]):
        if bad is None:
            continue
        with pytest.raises(BadInput, match="probe_tolerance"):
            parse_adapter_body({**body, "probe_tolerance": bad})


@pytest.mark.parametrize("status,body,exc,needle", [
    (400, {"error": "no lora_B"}, BadInput, "no lora_B"),
    (404, {"error": "not found"}, BadInput, "serve --lora"),
    (409, {"error": "budget", "refused": True}, UpdateRefused, "budget"),
    (409, {"error": "probe", "phase": "validate", "classification": "no_mutation"},
     UpdateFailed, "probe"),
])
def test_client_maps_the_gateways_answers(tmp_path: Path, status: int, body: dict[str, Any],
                                          exc: type[Exception], needle: str) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    gw = _Gateway(status, body)
    with pytest.raises(exc, match=needle):
        _client(gw).update_adapter(tmp_path / "a", Provenance("ck", "run", 4))
    sent = gw.requests[0]
    assert sent.url.path == "/control/adapters" and sent.method == "POST"
    import json

    assert json.loads(sent.content) == {"adapter_dir": str((tmp_path / "a").resolve()),
                                        "provenance": {"checkpoint": "ck",
                                                       "trainer_run": "run", "step": 4}}
    if status == 409 and "phase" in body:
        assert _client(_Gateway(200, {"current": None})).adapters() == {"current": None}
