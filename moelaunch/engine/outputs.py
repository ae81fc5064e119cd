"""What a request gives back (the vLLM shapes: RequestOutput with one CompletionOutput per sample)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    logprobs: list[dict[int, float]] | None = None  # per token: top ids -> log-probability
    token_logprobs: list[float] | None = None  # per token: the chosen token's log-probability


@dataclass
class RequestMetrics:
    arrival: float
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
