"""A choice's text as the API returns it: a chat reply's think section apart from its answer, and one
token's text for log-probabilities."""

from __future__ import annotations

from moelaunch.text.reasoning import split_reasoning
from moelaunch.text.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as text, special tokens included (for log-probabilities)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_message(text: str, opened: bool) -> dict[str, str]:
    """A finished chat choice's message: its answer, and its think section apart when it has one
    (`opened`: the prompt opened it, as split_reasoning takes it)."""
    reasoning, answer = split_reasoning(text, opened)
    message = {"role": "assistant", "content": answer}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message
