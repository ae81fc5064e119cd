"""Print a reply as its tokens arrive: the answer, not a think section before it."""

from __future__ import annotations

import sys
from typing import TextIO

from moelaunch.engine.outputs import RequestOutput
from moelaunch.text.reasoning import split_reasoning
from moelaunch.text.tokenizer import Tokenizer


class TextStreamer:
    """Step callback: prints the text a request's new tokens add. The whole reply is decoded each
    time, because a byte-level token can end in the middle of a character. A think section (DeepSeek-R1's
    hidden reasoning) is not printed; `text` is the answer after it."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO = sys.stdout) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.text = ""

    def __call__(self, progress: RequestOutput) -> None:
        ids = [t for t in progress.outputs[0].token_ids if t != self.tokenizer.eos_id]
        text = split_reasoning(self.tokenizer.decode(ids))[1]
        self.out.write(text[len(self.text) :])
        self.out.flush()
        self.text = text
