"""Per-request sampling settings, in the vLLM spelling, checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)  # strings that end the output (not included)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top log-probabilities to return per token
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"SamplingParams.{name}={value!r} must be a list")
            object.__setattr__(self, name, tuple(value))
        self._check_types()
        checks = [
            ("temperature", 0 <= self.temperature < math.inf, "must be >= 0 (0 means greedy) and finite"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (no limit) or >= 1"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be None or in [0, 20]"),
            ("n", self.n >= 1, "must be >= 1"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be None or in [0, 2^63)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "stop_token_ids",
                all(type(t) is int and t >= 0 for t in self.stop_token_ids),
                "must be ids >= 0",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {rule}")

    def _check_types(self) -> None:
        ints = ("top_k", "max_tokens", "min_tokens", "n")
        for name in ints + ("temperature", "top_p"):
            value = getattr(self, name)
            # bool is an int in Python, and 1.5 tokens is not a count.
            ok = isinstance(value, int) if name in ints else isinstance(value, (int, float))
            if not ok or isinstance(value, bool):
                kind = "an integer" if name in ints else "a number"
                raise ValueError(f"SamplingParams.{name}={value!r} must be {kind}")
        for name in ("seed", "logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"SamplingParams.{name}={value!r} must be an integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
