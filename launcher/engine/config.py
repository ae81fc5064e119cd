"""Engine settings: cache geometry and budget, batching limits, speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    block_size: int = 16
    max_num_batched_tokens: int = 2048  # per step and DP replica: bounds a step's prefill work
    max_num_seqs: int = 256
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    kv_cache_memory: int | None = None  # bytes per rank for the latent cache; None: a fraction of free memory
    kv_cache_fraction: float = 0.25
    enable_prefix_caching: bool = True
    micro_batches: int | None = None  # pipeline micro-batches per step; default: the number of stages
    seed: int = 0  # seeds sequences whose SamplingParams give none
    speculative: str | None = None  # "mtp": draft with the checkpoint's MTP layer, verify next step
    timeout_s: float = 300.0
    expert_placement: list[list[int]] | None = None  # expert -> EP ranks holding it (copies allowed)

    def __post_init__(self) -> None:
        checks = [
            ("block_size", self.block_size >= 1, ">= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1"),
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
            ("kv_cache_fraction", 0 < self.kv_cache_fraction <= 0.95, "in (0, 0.95]"),
            ("speculative", self.speculative in (None, "mtp"), "None or 'mtp'"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"engine setting {name}={getattr(self, name)!r} must be {rule}")
