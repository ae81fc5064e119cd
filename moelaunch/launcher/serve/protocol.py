"""The OpenAI request bodies the server accepts, validated into the engine's SamplingParams.

The sampling fields are SamplingParams' own (OpenAI's names and defaults, with vLLM's extensions top_k,
min_tokens, ignore_eos and stop_token_ids); max_tokens and logprobs are mapped from their OpenAI forms
here. Unknown fields are refused (400, naming the field) rather than silently ignored, except
the few clients send by habit whose values change nothing here (user, zero penalties).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from moelaunch.engine.sampling_params import SamplingParams, sampling_fields


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """What every request body has besides its sampling fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        sampling = self.model_dump(include=set(_WIRE_SAMPLING))
        # min_tokens is capped by the max_tokens that the context leaves, not refused.
        sampling["min_tokens"] = min(sampling["min_tokens"], max_tokens)
        return SamplingParams(**sampling, max_tokens=max_tokens, logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# SamplingParams' fields, with OpenAI's bounds on temperature and n; max_tokens and logprobs have their
# OpenAI names and forms in each request type.
_WIRE_SAMPLING = sampling_fields(exclude={"max_tokens", "logprobs"}, temperature=Field(le=2), n=Field(le=16))
_Sampling = create_model("_Sampling", __base__=_Request, **_WIRE_SAMPLING)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool fields...: passed to the chat template
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Prompt) -> Prompt:
        if value == "" or value == [] or any(v in ("", []) for v in value if isinstance(v, (str, list))):
            raise ValueError("a prompt must not be empty")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)
