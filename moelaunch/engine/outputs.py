"""What a request gives back (the vLLM shapes: RequestOutput with one CompletionOutput per sample)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moelaunch.engine.kv_handoff import KVHandoff


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    logprobs: list[dict[int, float]] | None = None  # per token: top ids -> log-probability
    token_logprobs: list[float] | None = None  # per token: the chosen token's log-probability
    error: str | None = None  # finish_reason "error": what went wrong


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
    kv_handoff: KVHandoff | None = None  # prefill-role engine: where the finished prompt's KV waits


ABORT = "abort"
ERROR = "error"  # the finish_reason of a sequence the engine could not continue
NON_FINITE_TOKEN = -2  # the sampler's token for a row whose logits are not all finite (-1 pads tables)


def non_finite_logits_error(tensors: list[str]) -> str:
    """The error of a sequence whose logits held a NaN or inf; `tensors`: those the load warned of."""
    if tensors:
        named = ", ".join(tensors[:4]) + (", ..." if len(tensors) > 4 else "")
        cause = f"the checkpoint holds NaN or inf weights ({named})"
    else:
        cause = (
            "the checkpoint's weights hold NaN or inf values (loading warns, naming the tensors), or the "
            "activations overflowed the compute dtype"
        )
    return f"the model produced non-finite logits (NaN or inf): {cause}; check or replace the checkpoint"


def raise_if_failed(outputs: list[RequestOutput]) -> None:
    """One ValueError for outputs that ended with an error (after the run: the others were served)."""
    failed = [(i, c.error) for i, out in enumerate(outputs) for c in out.outputs if c.error]
    if failed:
        i, error = failed[0]
        where = f"prompt {i} ({len(failed)} of the outputs failed): " if len(outputs) > 1 else ""
        raise ValueError(where + error)
