"""A choice's text as its tokens arrive, for streaming.

Each step the whole output is decoded again (a byte-level token can end inside a character), and only
text that can no longer change is sent: a trailing partial character waits for its next byte, and the
last (longest stop string - 1) characters wait until no stop string can still begin there, since the
engine cuts the output at a stop string. The finished text is the engine's own, stop strings cut.
"""

from __future__ import annotations

from moelaunch.launcher.serve.engine_loop import ChoiceProgress
from moelaunch.model.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what decoding shows for an incomplete UTF-8 sequence


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def delta(self, choice: ChoiceProgress) -> str:
        """The text to send for this snapshot (may be empty)."""
        if choice.finish_reason is not None:
            text = choice.text
        else:
            text = self.tokenizer.decode(list(choice.token_ids)).rstrip(REPLACEMENT)
            text = text[: max(len(text) - self.hold, len(self.sent))]
        if not text.startswith(self.sent):  # cannot happen with the holdback; never resend
            return ""
        out, self.sent = text[len(self.sent) :], text
        return out


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as text, special tokens included (for log-probabilities)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
