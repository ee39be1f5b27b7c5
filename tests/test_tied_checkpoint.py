"""``make_checkpoint(tie_word_embeddings=True)``: saved tied, as Hugging Face saves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.needs import installed
from rolloutcore.errors import BadInput
from rolloutcore.testing.models import make_checkpoint, make_pair
from rolloutcore.transports.source import WeightSource

installed("transformers")


def test_a_tied_pair_has_no_separate_head_and_is_hot_swappable(tmp_path: Path) -> None:
    a, b = make_pair(tmp_path, tie_word_embeddings=True)
    for d in (a, b):
        assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is True
    sa, sb = WeightSource.from_checkpoint(a), WeightSource.from_checkpoint(b)
    assert "lm_head.weight" not in sa.manifest().names()
    assert "model.embed_tokens.weight" in sa.manifest().names()
    assert sa.manifest().digest == sb.manifest().digest
    assert sa.content_digest() != sb.content_digest()
    neg = make_checkpoint(tmp_path / "neg", 1, like=a, negate_layer=0)
    assert json.loads((neg / "config.json").read_text())["tie_word_embeddings"] is True
    assert WeightSource.from_checkpoint(neg).manifest().digest == sa.manifest().digest

    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(a))
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_untied_stays_the_default_and_a_mismatch_with_like_is_refused(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", 1)
    assert json.loads((a / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in WeightSource.from_checkpoint(a).manifest().names()
    with pytest.raises(BadInput, match="differs from"):
        make_checkpoint(tmp_path / "b", 1, like=a, negate_layer=0, tie_word_embeddings=True)
    with pytest.raises(BadInput, match="boolean"):
        make_checkpoint(tmp_path / "c", 1, tie_word_embeddings="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
