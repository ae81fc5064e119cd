"""POST /tokenize and /detokenize, as vLLM has them: a prompt or chat messages to token ids (with the
context length, so a client can size its request), and token ids back to text."""

from __future__ import annotations

from typing import Any

import jinja2
from pydantic import BaseModel, ConfigDict, Field

from moelaunch.launcher.serve.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the tokenizer adds none; accepted for vLLM's clients
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


def tokenize(state: Any, req: TokenizeRequest) -> dict[str, Any]:
    """ValueError when neither or both of prompt and messages are given, or the template fails."""
    if (req.prompt is None) == (req.messages is None):
        raise ValueError("give exactly one of prompt (text) or messages (a chat)")
    tok = state.tokenizer
    if req.prompt is not None:
        ids = tok.encode(req.prompt)
    else:
        try:
            messages = [m.as_template_input() for m in req.messages]
            allowed = state.special_tokens_in_content
            ids = tok.encode_chat(messages, req.add_generation_prompt, special_tokens_in_content=allowed)
        except (jinja2.TemplateError, TypeError) as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from None
    strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(state: Any, req: DetokenizeRequest) -> dict[str, Any]:
    vocab = state.tokenizer.vocab_size
    outside = [t for t in req.tokens if not 0 <= t < vocab]
    if outside:
        raise ValueError(f"token id {outside[0]} is not in the vocabulary (ids 0..{vocab - 1})")
    return {"prompt": state.tokenizer.decode(req.tokens)}
