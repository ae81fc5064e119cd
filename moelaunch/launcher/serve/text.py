"""A choice's text as its tokens arrive, for streaming.

Each step the whole output is decoded again (a byte-level token can end inside a character), and only
text that can no longer change is sent: a trailing partial character waits for its next byte, and the
last (longest stop string - 1) characters wait until no stop string can still begin there, since the
engine cuts the output at a stop string. The finished text is the engine's own, stop strings cut.
A chat reply's think section goes out apart from its answer (ReasoningSplit, chat_message).
"""

from __future__ import annotations

from moelaunch.launcher.serve.engine_loop import ChoiceProgress
from moelaunch.text.reasoning import split_reasoning
from moelaunch.text.tokenizer import Tokenizer

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


class ReasoningSplit:
    """A chat choice's streamed text as message fields: the think section as `reasoning_content`
    (DeepSeek's API field), the rest as `content`. It relies on the think tags being single tokens,
    as in DeepSeek-R1's vocabulary, so a streamed prefix never ends inside a tag."""

    def __init__(self) -> None:
        self.text = ""
        self._sent: tuple[str | None, str] = (None, "")  # the split of `text`, as sent so far

    def delta(self, new_text: str) -> dict[str, str]:
        self.text += new_text
        (sent_reasoning, sent_answer), (reasoning, answer) = self._sent, split_reasoning(self.text)
        self._sent = (reasoning, answer)
        fields = {}
        if reasoning is not None and len(reasoning) > len(sent_reasoning or ""):
            fields["reasoning_content"] = reasoning[len(sent_reasoning or "") :]
        if len(answer) > len(sent_answer):
            fields["content"] = answer[len(sent_answer) :]
        return fields or {"content": ""}


def chat_message(text: str) -> dict[str, str]:
    """A finished chat choice's message: its answer, and its think section apart when it has one."""
    reasoning, answer = split_reasoning(text)
    message = {"role": "assistant", "content": answer}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message
