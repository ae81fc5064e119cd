"""Hidden reasoning in a reply, as DeepSeek-R1 writes it: `<think>reasoning</think>answer`.

The chat shows the answer, the API returns the reasoning as `reasoning_content` beside it, and the
chat template drops the reasoning of earlier turns from the history, as R1's template does.
"""

from __future__ import annotations

from moelaunch.text.tokenizer import Tokenizer

THINK_START, THINK_END = "<think>", "</think>"
# Enough of a prompt's last tokens to hold "<think>" and the whitespace a template puts after it.
PROMPT_TAIL_TOKENS = 8


def with_reasoning(reasoning: str, answer: str) -> str:
    """The reply text a model writes for `answer` reached through `reasoning` (none when empty)."""
    return f"{THINK_START}{reasoning}{THINK_END}{answer}" if reasoning else answer


def prompt_opens_reasoning(tokenizer: Tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the chat template already opened the think section (DeepSeek-R1's ends its generation
    prompt with `<think>\n`), so the reply starts inside it."""
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rstrip().endswith(THINK_START)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, answer) of a reply; reasoning is None when the reply has no closed think section.

    An unclosed section (the reply was cut off while thinking) is all reasoning and no answer yet.
    `opened`: the prompt opened the section (prompt_opens_reasoning), so the reply starts in it.
    """
    if opened:
        text = THINK_START + text
    head, sep, answer = text.partition(THINK_END)
    if not sep:
        return (text.removeprefix(THINK_START), "") if text.startswith(THINK_START) else (None, text)
    return head.removeprefix(THINK_START), answer


class ReasoningSplit:
    """A reply's streamed text as message fields: the think section as `reasoning_content` (DeepSeek's
    API field), the rest as `content`. It relies on the think tags being single tokens, as in
    DeepSeek-R1's vocabulary, so a streamed prefix never ends inside a tag. `opened`: as for
    split_reasoning; without it the reasoning of an R1-style reply would go out first as content."""

    def __init__(self, opened: bool = False) -> None:
        self.text = THINK_START if opened else ""
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

    @property
    def answer(self) -> str:
        return self._sent[1]
