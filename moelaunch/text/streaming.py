"""A reply's text as its tokens arrive, for streaming it (the server's chunks, the chat's terminal).

Each step the whole output is decoded again (a byte-level token can end inside a character), and only
text that can no longer change is given out: a trailing partial character waits for its next byte, and
the last (longest stop string - 1) characters wait until no stop string can still begin there, since
the engine cuts the output at a stop string. The finished text is the engine's own, stop strings cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from moelaunch.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what decoding shows for an incomplete UTF-8 sequence


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def delta(self, token_ids: Sequence[int], finished_text: str | None = None) -> str:
        """The text the output's tokens so far add (may be empty); `finished_text` is the engine's
        text once the output is finished."""
        if finished_text is not None:
            text = finished_text
        else:
            text = self.tokenizer.decode(list(token_ids)).rstrip(REPLACEMENT)
            text = text[: max(len(text) - self.hold, len(self.sent))]
        if not text.startswith(self.sent):  # cannot happen with the holdback; never resend
            return ""
        out, self.sent = text[len(self.sent) :], text
        return out
