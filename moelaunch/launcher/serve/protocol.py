"""The OpenAI request bodies the server accepts, validated into the engine's SamplingParams.

Field names and defaults follow OpenAI's API (with vLLM's extensions top_k, min_tokens, ignore_eos and
stop_token_ids). Unknown fields are refused (400, naming the field) rather than silently ignored, except
the few clients send by habit whose values change nothing here (user, zero penalties).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from moelaunch.engine.sampling_params import SamplingParams

# 2^63: seeds seed a torch.Generator, which takes a signed 64-bit value.
MAX_SEED = 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=16)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0:
            raise ValueError("0 is no token; use -1 for no limit or a count >= 1")
        return value

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            n=self.n,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


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
