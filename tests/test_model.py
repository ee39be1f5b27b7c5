"""Tiny offline checkpoints: loadable, deterministic, hot-swappable pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.needs import installed
from rolloutcore.cli import main as cli_main
from rolloutcore.errors import BadInput
from rolloutcore.testing.models import (
    EOS_ID,
    VOCAB_SIZE,
    make_checkpoint,
    make_pair,
)
from rolloutcore.transports.source import WeightSource

torch = pytest.importorskip("torch")
installed("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("models")
    a, b = make_pair(root)
    neg = make_checkpoint(root / "A_neg", 1, like=a, negate_layer=0)
    return a, b, neg


def test_checkpoint_is_a_llama_vllm_can_read(pair: tuple[Path, Path, Path]) -> None:
    a, _, _ = pair
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] == VOCAB_SIZE
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 32
    assert cfg["max_position_embeddings"] >= 1024
    man = WeightSource.from_checkpoint(a).manifest()
    assert {p.dtype for p in man.params} == {"bfloat16"}
    assert "model.layers.1.self_attn.q_proj.weight" in man.names()


def test_tokenizer_is_byte_level_and_round_trips(pair: tuple[Path, Path, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair[0]))
    text = "héllo, wörld! 123"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert tok.eos_token_id == EOS_ID
    assert len(tok) == VOCAB_SIZE


def test_same_seed_same_bytes_other_seed_same_manifest(
        pair: tuple[Path, Path, Path], tmp_path: Path) -> None:
    a, b, _ = pair
    again = make_checkpoint(tmp_path / "A2", 1)
    sa, sb, s2 = (WeightSource.from_checkpoint(p) for p in (a, b, again))
    assert sa.content_digest() == s2.content_digest()
    assert sa.manifest() == sb.manifest()
    assert sa.content_digest() != sb.content_digest()


def test_negate_layer_changes_exactly_that_layer(pair: tuple[Path, Path, Path]) -> None:
    a, _, neg = pair
    ta = dict(WeightSource.from_checkpoint(a).named_tensors())
    tn = dict(WeightSource.from_checkpoint(neg).named_tensors())
    assert ta.keys() == tn.keys()
    for name in ta:
        if name.startswith("model.layers.0."):
            assert torch.equal(tn[name], -ta[name]), name
        else:
            assert torch.equal(tn[name], ta[name]), name
    assert (neg / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def test_bad_input_changes_nothing(pair: tuple[Path, Path, Path], tmp_path: Path) -> None:
    a, _, _ = pair
    with pytest.raises(BadInput):
        make_checkpoint(a, 5)  # not empty
    with pytest.raises(BadInput):
        make_checkpoint(tmp_path / "x", -1)
    with pytest.raises(BadInput):
        make_checkpoint(tmp_path / "x", 1, like=a)  # negate_layer missing
    with pytest.raises(BadInput):
        make_checkpoint(tmp_path / "x", 1, like=a, negate_layer=7)
    with pytest.raises(BadInput):
        make_checkpoint(tmp_path / "x", 1, like=tmp_path, negate_layer=0)
    assert not (tmp_path / "x").exists()


def test_cli_make_like(pair: tuple[Path, Path, Path], tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    a, _, neg = pair
    out = tmp_path / "cli"
    assert cli_main(["model", "make", "--out", str(out), "--seed", "1", "--like", str(a),
                     "--negate-layer", "0"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (WeightSource.from_checkpoint(out).content_digest()
            == WeightSource.from_checkpoint(neg).content_digest())
    assert cli_main(["model", "make", "--out", str(out), "--seed", "1"]) == 2
    assert "rolloutcore: error:" in capsys.readouterr().err


def test_cli_make_vlm_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--arch vlm``: the tiny Idefics3 pair; B keeps A's text weights, not its vision tower."""
    from safetensors import safe_open

    a, b = tmp_path / "A", tmp_path / "B"
    assert cli_main(["model", "make", "--arch", "vlm", "--out", str(a), "--seed", "1"]) == 0
    assert cli_main(["model", "make", "--arch", "vlm", "--out", str(b), "--seed", "1",
                     "--like", str(a), "--new-vision-seed", "2"]) == 0
    assert capsys.readouterr().out.split() == [str(a), str(b)]

    def tensors(d: Path) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as s:
                for k in s.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[k] = s.get_tensor(k).float().numpy().tobytes()
        return out

    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    differ = {k for k in ta if ta[k] != tb[k]}
    assert differ and all("vision" in k or "connector" in k for k in differ)
    # Flags of the other architecture are refused with a clear error, nothing written.
    for bad in (["--arch", "vlm", "--negate-layer", "0"], ["--arch", "vlm", "--like", str(a)],
                ["--new-vision-seed", "2"]):
        out = tmp_path / "bad"
        assert cli_main(["model", "make", "--out", str(out), "--seed", "1", *bad]) == 2
        assert "rolloutcore: error:" in capsys.readouterr().err and not out.exists()
