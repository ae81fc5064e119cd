"""Hidden reasoning in a reply, as DeepSeek-R1 writes it: `<think>reasoning</think>answer`.

The chat shows the answer, the API returns the reasoning as `reasoning_content` beside it, and the
chat template drops the reasoning of earlier turns from the history, as R1's template does.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def with_reasoning(reasoning: str, answer: str) -> str:
    """The reply text a model writes for `answer` reached through `reasoning` (none when empty)."""
    return f"{THINK_START}{reasoning}{THINK_END}{answer}" if reasoning else answer


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a reply; reasoning is None when the reply has no closed think section.

    An unclosed section (the reply was cut off while thinking) is all reasoning and no answer yet.
    """
    head, sep, answer = text.partition(THINK_END)
    if not sep:
        return (text.removeprefix(THINK_START), "") if text.startswith(THINK_START) else (None, text)
    return head.removeprefix(THINK_START), answer
