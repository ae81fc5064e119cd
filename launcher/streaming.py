"""Print a reply as its tokens arrive."""

from __future__ import annotations

import sys
from typing import TextIO

from model.tokenizer import Tokenizer


class TextStreamer:
    """Callback for generated tokens: prints the text each one adds. The whole reply is decoded each
    time, because a byte-level token can end in the middle of a character."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO = sys.stdout) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.text = ""

    def __call__(self, _request_id: int, token: int) -> None:
        if token == self.tokenizer.eos_id:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        self.out.write(text[len(self.text) :])
        self.out.flush()
        self.text = text
