"""OpenAI response bodies: whole responses, stream chunks, log-probabilities, usage and errors."""

from __future__ import annotations

import time
from typing import Any

from moelaunch.launcher.serve.engine_loop import ChoiceProgress
from moelaunch.launcher.serve.text import token_text
from moelaunch.text.tokenizer import Tokenizer

CHAT = "chat.completion"
COMPLETION = "text_completion"


def error_body(message: str, kind: str, param: str | None = None, code: int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def envelope(object_kind: str, response_id: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": object_kind, "created": created or int(time.time()), "model": model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(
    tokenizer: Tokenizer, choice: ChoiceProgress, start: int, end: int
) -> dict[str, list[dict[str, Any]]]:
    """Chat's shape for tokens [start, end) of a choice."""
    content = []
    for i in range(start, end):
        token = choice.token_ids[i]
        top = (
            sorted(choice.top_logprobs[i].items(), key=lambda kv: -kv[1])
            if i < len(choice.top_logprobs)
            else []
        )
        content.append(
            {
                **_token_entry(tokenizer, token, choice.token_logprobs[i]),
                "top_logprobs": [_token_entry(tokenizer, t, lp) for t, lp in top],
            }
        )
    return {"content": content}


def completion_logprobs(
    tokenizer: Tokenizer, choice: ChoiceProgress, start: int, end: int, text_offset: int
) -> dict[str, list[Any]]:
    """Completions' shape for tokens [start, end) of a choice; offsets count from text_offset."""
    tokens = [token_text(tokenizer, t) for t in choice.token_ids[start:end]]
    offsets, at = [], text_offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = [
        _top_by_text(tokenizer, choice.top_logprobs[i])
        for i in range(start, min(end, len(choice.top_logprobs)))
    ]
    return {
        "tokens": tokens,
        "token_logprobs": list(choice.token_logprobs[start:end]),
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _top_by_text(tokenizer: Tokenizer, top: dict[int, float]) -> dict[str, float]:
    """Top log-probabilities keyed by token text; tokens that print alike (partial UTF-8) keep the best."""
    out: dict[str, float] = {}
    for token, logprob in sorted(top.items(), key=lambda kv: -kv[1]):
        out.setdefault(token_text(tokenizer, token), logprob)
    return out


def _token_entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
