"""Print a reply as its tokens arrive."""

from __future__ import annotations

import sys
from typing import TextIO

from moelaunch.launcher.engine.outputs import RequestOutput
from moelaunch.model.tokenizer import Tokenizer


class TextStreamer:
    """Step callback: prints the text a request's new tokens add. The whole reply is decoded each
    time, because a byte-level token can end in the middle of a character."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO = sys.stdout) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.text = ""

    def __call__(self, progress: RequestOutput) -> None:
        ids = [t for t in progress.outputs[0].token_ids if t != self.tokenizer.eos_id]
        text = self.tokenizer.decode(ids)
        self.out.write(text[len(self.text) :])
        self.out.flush()
        self.text = text
