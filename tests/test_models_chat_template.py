"""Generated tiny models carry a chat template: chat clients work against them.

vLLM refuses ``/v1/chat/completions`` (400) for a tokenizer without one; the
real-engine side is tests/engine/test_openai_sdk_engine.py.
"""

from __future__ import annotations

from pathlib import Path

from helpers.needs import installed
from rolloutcore.testing.models import BOS_ID, CHAT_TEMPLATE, make_checkpoint

installed("transformers")


def test_the_tokenizer_renders_messages_with_role_markers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    d = make_checkpoint(tmp_path / "m", 3)
    assert (d / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    tok = AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    assert ids[0] == BOS_ID
    assert tok.decode(ids[1:]) == "<|system|>\nS\n<|user|>\nHi\n<|assistant|>\n"
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert no_gen == "<s><|system|>\nS\n<|user|>\nHi\n"
    # Every rendered id is a byte or a special token: the engine accepts them.
    assert all(0 <= i < 259 for i in ids)
