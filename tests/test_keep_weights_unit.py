"""``train --keep-weights`` (#48): every published version's weights kept, by label."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rolloutcore.cli import build_parser, main
from rolloutcore.cli.keep_weights import WeightKeeper, estimate_bytes

torch = pytest.importorskip("torch")


class _Model:
    """What the keeper uses of a Hugging Face model: parameters, state_dict, save_pretrained."""

    def __init__(self) -> None:
        self.w = torch.ones(3, 4)

    def parameters(self) -> list[Any]:
        return [self.w]

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def save_pretrained(self, d: Path, *, state_dict: dict[str, Any],
                        safe_serialization: bool) -> None:
        d.mkdir(parents=True, exist_ok=True)
        assert state_dict["w"].dtype == torch.bfloat16 and safe_serialization
        (d / "model.safetensors").write_text(str(float(state_dict["w"].sum())))


class _Tokenizer:
    def save_pretrained(self, d: Path) -> None:
        (d / "tokenizer.json").write_text("{}")


def test_each_published_version_is_kept_under_its_label(tmp_path: Path) -> None:
    model = _Model()
    keeper = WeightKeeper(tmp_path / "weights", tmp_path / "policy-0", _Tokenizer(), "rc-0")
    keeper.before_generation(model)
    keeper.published(None)                # step 0: no update, nothing kept
    model.w += 1
    keeper.before_generation(model)
    keeper.published("rc-1")
    model.w += 1
    keeper.before_generation(model)
    keeper.published("rc-2")
    index = json.loads((tmp_path / "weights" / "versions.json").read_text())
    assert index == {"rc-0": str(tmp_path / "policy-0"),
                     "rc-1": str(tmp_path / "weights" / "rc-1"),
                     "rc-2": str(tmp_path / "weights" / "rc-2")}
    assert (tmp_path / "weights" / "rc-1" / "model.safetensors").read_text() == "24.0"
    assert (tmp_path / "weights" / "rc-2" / "model.safetensors").read_text() == "36.0"
    assert not (tmp_path / "weights" / ".pending").exists()
    assert keeper.to_dict()["versions"] == 3 and keeper.to_dict()["bytes"] > 0
    assert estimate_bytes(model) == 24


def test_keep_weights_is_documented_and_refused_with_lora(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    helptext = build_parser("train")._subparsers._group_actions[0].choices[  # type: ignore[union-attr]
        "train"].format_help()
    assert "--keep-weights" in helptext and "MB a version" in helptext
    assert main(["train", "--lora", "--keep-weights", "--workdir", str(tmp_path / "w")]) == 2
    assert "--keep-weights is for full training" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
