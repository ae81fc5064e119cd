"""What the engine reports about itself after each step: load, cache use, prefix hits, preemptions and
speculative acceptance, summed over the DP replicas (each replica's reporter sends its own with its
tokens, so the figures cost no extra collective)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineStats:
    running: int = 0  # sequences in the running batch
    waiting: int = 0  # sequences queued or preempted, waiting for room
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prompt_tokens_admitted: int = 0  # prompt tokens of admitted sequences: the prefix cache's queries
    prefix_hit_tokens: int = 0  # of those, found in the prefix cache
    preemptions: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    kv_bytes_received: int = 0  # prefilled prompts' latents read by the reporting rank (disaggregation)

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens_admitted if self.prompt_tokens_admitted else 0.0

    @property
    def spec_acceptance(self) -> float | None:
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else None
