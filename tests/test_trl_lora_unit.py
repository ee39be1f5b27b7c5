"""``rolloutcore train --lora`` without an engine: its arguments, its LoRA config, the
adapter in the trajectory record and the audit's adapter checks.

The run itself (TRL with ``peft_config``, vLLM with LoRA) is
tests/engine/test_trl_lora_engine.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from helpers.trajtools import IDENTITY, make_sample, version
from rolloutcore.cli import build_parser, main
from rolloutcore.cli.train import LORA_LR, LoraSettings, _lora_args
from rolloutcore.control.journal import Journal
from rolloutcore.core.adapters import AdapterChange, AdapterEvent, AdapterState, AdapterVersion
from rolloutcore.core.records import Commit
from rolloutcore.errors import BadInput
from rolloutcore.integrations.trl.rollout import lora_engine_args
from rolloutcore.provenance.audit import PurityIssue, audit_purity, read_journal_summary
from rolloutcore.provenance.trajectory import AdapterUse, TrajectorySample

DIGEST = "ab" * 32


@pytest.mark.parametrize(("argv", "said"), [
    (["train", "--lora", "--lora-rank", "0"], "must be in 1..512"),
    (["train", "--lora", "--lora-rank", "513"], "must be in 1..512"),
    (["train", "--lora", "--lora-rank", "x"], "not an integer"),
    (["train", "--lora", "--lora-alpha", "0"], "must be in 1..1000000"),
    (["train", "--lora", "--lr", "0"], "positive number"),
])
def test_bad_lora_arguments_are_refused_by_the_parser(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        build_parser("train").parse_args(argv)
    assert ei.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "said"), [
    (["--lora-rank", "8"], "--lora-rank need --lora"),
    (["--lora-alpha", "4", "--lora-targets", "q_proj"], "--lora-alpha, --lora-targets need"),
    (["--lora", "--lora-targets", "q_proj,lm_head"], "['lm_head'] are not projections"),
    (["--lora", "--lora-targets", ","], "non-empty"),
    (["--lora", "--lora-targets", "q_proj,q_proj"], "repeat a module"),
])
def test_bad_lora_input_exits_2_before_anything_is_made(
        argv: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ROLLOUTCORE_TOKEN", "t" * 32)
    work = tmp_path / "w"
    rc = main(["train", *[a for a in argv if a != "--token-file" and a != "/dev/null"],
               "--workdir", str(work), "--quiet"])
    assert rc == 2 and said in capsys.readouterr().err
    assert not work.exists()


def test_the_lora_settings_and_peft_config_by_default_and_as_asked() -> None:
    pytest.importorskip("peft")
    args = build_parser("train").parse_args(["train", "--lora"])
    lora = _lora_args(args)
    assert lora == LoraSettings(8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"))
    assert args.lr is None and LORA_LR > 2e-3   # run_train takes LORA_LR for a LoRA run
    cfg = lora.peft_config()
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, cfg.bias) == (8, 16, 0.0, "none")
    assert set(cfg.target_modules) == set(lora.targets)
    assert str(cfg.task_type.value if hasattr(cfg.task_type, "value") else cfg.task_type) \
        == "CAUSAL_LM"
    small = _lora_args(build_parser("train").parse_args(
        ["train", "--lora", "--lora-rank", "4", "--lora-targets", "q_proj, v_proj"]))
    assert small == LoraSettings(4, 8, ("q_proj", "v_proj"))   # alpha 2 x rank
    assert small.to_dict() == {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"],
                               "dropout": 0.0}
    assert _lora_args(build_parser("train").parse_args(["train"])) is None


@pytest.mark.parametrize("bad", [{"rank": 0}, {"rank": True}, {"rank": 600},
                                 {"alpha": 0}, {"alpha": 1.5}, {"targets": ()},
                                 {"targets": "q_proj"}])
def test_bad_lora_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(BadInput):
        LoraSettings(**bad)  # type: ignore[arg-type]


def test_the_engine_is_started_with_a_max_lora_rank_vllm_accepts() -> None:
    assert lora_engine_args(8) == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    assert lora_engine_args(5)[-1] == "8" and lora_engine_args(9)[-1] == "16"
    assert lora_engine_args(1)[-1] == "1" and lora_engine_args(300)[-1] == "320"
    for bad in (0, 513, True, "8"):
        with pytest.raises(BadInput, match="LoRA rank"):
            lora_engine_args(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- records

def _adapted(base_generation: int = 1, *, name: str = "rcl-3-" + "ab" * 8,
             generation: int = 3, digest: str = DIGEST) -> TrajectorySample:
    s = make_sample(tokens=range(6), bound=version(base_generation))
    return dataclasses.replace(s, adapter=AdapterUse(name, generation, digest,
                                                     version(base_generation).label))


def test_a_sample_through_an_adapter_is_schema_5_and_reads_back() -> None:
    s = _adapted()
    d = json.loads(s.encode())
    assert d["schema_version"] == 5 and d["adapter"] == {
        "name": "rcl-3-" + "ab" * 8, "generation": 3, "content_digest": DIGEST, "base": "rc-1"}
    assert TrajectorySample.from_dict(d) == s
    plain = make_sample()
    assert json.loads(plain.encode())["schema_version"] == 1   # unchanged without one
    d4 = dict(d, schema_version=4)
    with pytest.raises(BadInput, match=r"unknown keys \[.adapter.\]"):
        TrajectorySample.from_dict(d4)
    with pytest.raises(BadInput):
        TrajectorySample.from_dict(dict(d, adapter={**d["adapter"], "path": "/x"}))


def test_an_adapter_verified_on_another_base_is_refused_in_the_record() -> None:
    s = make_sample(bound=version(2))
    with pytest.raises(BadInput, match="verified on base rc-1"):
        dataclasses.replace(s, adapter=AdapterUse("rcl-1-" + "ab" * 8, 1, DIGEST, "rc-1"))
    with pytest.raises(BadInput):
        AdapterUse("rcl-1", 0, DIGEST, "rc-1")
    with pytest.raises(BadInput):
        AdapterUse("rcl-1", 1, "nothex", "rc-1")


def _journal(path: Path, published: AdapterVersion | None) -> Path:
    j = Journal(path)
    for g in range(2):
        j.write(Commit(version(g), IDENTITY))
    if published is not None:
        v = published
        j.write(AdapterChange(v.name, v.generation, v.content_digest, v.base, v.path, None,
                              AdapterState.LOADING, None))
        j.write(AdapterChange(v.name, v.generation, v.content_digest, v.base, v.path,
                              AdapterState.VERIFYING, AdapterState.PUBLISHED,
                              AdapterEvent.VERIFIED, "every check passed"))
    j.close()
    return path


def test_the_audit_checks_each_sample_s_adapter_against_the_journal(tmp_path: Path) -> None:
    v = AdapterVersion(3, "rcl-3-" + "ab" * 8, "/tmp/rcl-3", DIGEST, "rc-1")
    summary = read_journal_summary(_journal(tmp_path / "j.jsonl", v))
    assert summary.adapters == {v.name: {(3, DIGEST, "rc-1")}}
    assert audit_purity([_adapted()], summary).ok
    # never published (only loaded: a version refused after its load is not one)
    r = audit_purity([_adapted(name="rcl-4-" + "cd" * 8, generation=4)], summary)
    assert [f.issue for f in r.findings] == [PurityIssue.UNPUBLISHED_ADAPTER]
    # published with other content
    r = audit_purity([_adapted(digest="cd" * 32)], summary)
    assert [f.issue for f in r.findings] == [PurityIssue.ADAPTER_MISMATCH]
    assert "sha256 abababab" in r.findings[0].detail
    # a journal with no adapter published at all
    none = read_journal_summary(_journal(tmp_path / "none.jsonl", None))
    r = audit_purity([_adapted()], none)
    assert [f.issue for f in r.findings] == [PurityIssue.UNPUBLISHED_ADAPTER]
    assert "1 LoRA-adapter versions published" in audit_purity([_adapted()], summary
                                                                ).format_table()


def test_replay_of_an_adapter_sample_needs_that_adapter_listed_on_the_base() -> None:
    from rolloutcore.provenance.replay import adapter_issue

    s = _adapted()
    name = s.adapter.name if s.adapter else ""
    assert adapter_issue(make_sample(), {}) is None          # no adapter: nothing to check
    assert adapter_issue(s, {"policy": None, name: "policy"}) is None
    assert "does not list" in str(adapter_issue(s, {"policy": None}))
    assert "base model here" in str(adapter_issue(s, {name: None}))
    other = _adapted(name="rcl-3-" + "cd" * 8)               # a name without its digest
    assert "does not carry its content digest" in str(
        adapter_issue(other, {other.adapter.name if other.adapter else "": "policy"}))


def test_launch_refuses_adapter_options_without_a_rank_before_starting_anything(
        tmp_path: Path) -> None:
    from rolloutcore.core.adapters import AdapterConfig
    from rolloutcore.integrations.trl import RolloutCoreRollout

    for kw in ({"adapter_config": AdapterConfig()}, {"adapters": True},
               {"lora_rank": 0}, {"lora_rank": 8, "adapter_config": {"max_loaded": 4}}):
        with pytest.raises(BadInput):
            RolloutCoreRollout.launch(tmp_path / "nowhere", run="r", **kw)  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="adapter_dir is for adapters=True"):
        RolloutCoreRollout.through_gateway("http://127.0.0.1:9", "t", checkpoint=tmp_path,
                                           run="r", adapter_dir=tmp_path)
