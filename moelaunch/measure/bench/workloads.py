"""The requests a benchmark sends: random token ids, fixed or random lengths, never stopping early
(ignore_eos), so every system generates exactly the same number of tokens for the same prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Case:
    name: str
    requests: list[BenchRequest]
    batch_size: int | None  # requests decoding together by construction; None: a throughput mix

    @property
    def max_len(self) -> int:
        return max(len(r.prompt_ids) + r.output_len for r in self.requests)


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # Ids 0 and 1 are bos/eos in DeepSeek vocabularies; random text never contains them.
    return [rng.randrange(2, vocab_size) for _ in range(length)]


def _around(rng: random.Random, mean: int, range_ratio: float) -> int:
    return max(1, rng.randint(round(mean * (1 - range_ratio)), round(mean * (1 + range_ratio))))


def throughput_case(
    num_requests: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> Case:
    """N requests all submitted at once, lengths uniform in mean * [1 - ratio, 1 + ratio]."""
    rng = random.Random(seed)
    requests = [
        BenchRequest(
            _prompt(rng, _around(rng, input_len, range_ratio), vocab_size),
            _around(rng, output_len, range_ratio),
        )
        for _ in range(num_requests)
    ]
    return Case("throughput", requests, None)


def latency_cases(
    batch_sizes: list[int], input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[Case]:
    """For each batch size B, B requests of exactly input_len / output_len tokens submitted together.
    Each case has its own prompts, so no prefix cache carries over from an earlier case."""
    cases = []
    for b in batch_sizes:
        rng = random.Random(seed * 1000 + b)
        requests = [BenchRequest(_prompt(rng, input_len, vocab_size), output_len) for _ in range(b)]
        cases.append(Case(f"latency-b{b}", requests, b))
    return cases


def warmup_case(vocab_size: int) -> Case:
    """A short untimed run per system first: allocator, thread pools and lazy inits settle."""
    rng = random.Random(-1)
    return Case("warmup", [BenchRequest(_prompt(rng, 32, vocab_size), 8) for _ in range(2)], 2)
