"""The task family's tokenizer: DeepSeek-V3's special tokens and chat template over a tiny vocabulary.

One printable ASCII character a token (anything else is <unk>): digit-wise arithmetic and letter-wise
word games need single characters, and a word typed in any capitalisation or with stray spaces is
still made of known tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from moelaunch.text.reasoning import THINK_END, THINK_START

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
UNK = "<unk>"
# Ids 0 and 1 are bos and eos, as in DeepSeek-V3.
SPECIAL = (BOS, EOS, PAD, USER, ASSISTANT)
BOS_ID, EOS_ID, PAD_ID = (SPECIAL.index(t) for t in (BOS, EOS, PAD))
CHARS = tuple(chr(c) for c in range(32, 127))
# The think section's tags are one token each, as in DeepSeek-R1, and not special: decoding keeps them.
THINK_TAGS = (THINK_START, THINK_END)

# DeepSeek-V3's template shape: bos, system text, then <｜User｜>/<｜Assistant｜> turns, each
# assistant turn closed by eos. As DeepSeek-R1's, it drops an earlier reply's think section: the
# history holds answers only, whether the chat, the API's client or the evaluation sends it back.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '" + ASSISTANT + "' + message['content'].split('" + THINK_END + "')[-1] + eos_token }}"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate((*SPECIAL, UNK, *CHARS, *THINK_TAGS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])
    return tok


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json in the layout of DeepSeek-V3's."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    )
