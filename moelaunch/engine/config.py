"""Engine settings: cache geometry, dtype and budget, attention approximations, batching limits,
speculative decoding.

One type for every way of setting them: the `engine:` section of a deployment file is validated as this
model, `LLM(...)` keyword options build it, and the engine (and its scheduler) read it as it is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moelaunch.model.kv_cache import SparseAttention


class AttentionConfig(BaseModel):
    """Approximate attention for long contexts (both off by default, at most one on): cheaper, but the
    outputs differ from the model's full attention once a sequence outgrows the limit."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    window: int | None = Field(
        None,
        ge=1,
        description="APPROXIMATION: sliding window; each token attends to the last `window` tokens and "
        "itself only (prefill and decode), and KV blocks every later token has left behind are freed",
    )
    topk_blocks: int | None = Field(
        None,
        ge=1,
        description="APPROXIMATION: sparse attention; each token (prompt tokens too) attends to the K cached "
        "blocks whose mean latent scores highest against it, plus its own block",
    )

    @model_validator(mode="after")
    def _one_of(self) -> AttentionConfig:
        self.sparse()  # SparseAttention refuses window together with topk_blocks
        return self

    def sparse(self) -> SparseAttention:
        """These settings as the model's cache takes them."""
        return SparseAttention(self.window, self.topk_blocks)


class EplbConfig(BaseModel):
    """Expert load balancing from measured load: every `interval` steps the engine places the routed
    experts anew from the tokens routed over the last `window` steps (DeepSeek's EPLB), with
    `redundant_experts` extra copies of the busiest ones, and moves their weights between the EP ranks
    without a restart."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    window: int = Field(1000, ge=1, description="steps of routed load the placement is computed from")
    interval: int = Field(3000, ge=1, description="steps between two placements")
    redundant_experts: int = Field(
        0, ge=0, description="extra expert copies over the EP group; n_routed_experts + this divisible by ep"
    )


class EngineConfig(BaseModel):
    # strict: "8" for an int is a mistake to report, not something to coerce.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    max_model_len: int | None = Field(
        None, ge=1, description="tokens per sequence; default: the model's max_position_embeddings, <= 8192"
    )
    max_num_seqs: int = Field(256, ge=1, description="sequences running at once per DP replica")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="tokens per engine step per DP replica (bounds a step's prefill work)"
    )
    block_size: int = Field(16, ge=1, description="tokens per KV cache block")
    kv_cache_memory: int | None = Field(
        None,
        ge=1,
        description="bytes per rank for the latent cache; default: a kv_cache_fraction of free memory",
    )
    kv_cache_fraction: float | None = Field(
        None,
        gt=0,
        le=0.95,
        description="share of free memory for the cache; default: 0.9 of a GPU's (what the weights left), "
        "0.25 of the host's available RAM on the CPU (shared with everything else on the machine)",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="auto: the model's compute dtype; fp8: e4m3 values with two fp32 scales per token "
        "and layer, about half the bytes of bf16, so about twice the tokens in the same memory",
    )
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    enable_prefix_caching: bool = True
    micro_batches: int | None = Field(
        None, ge=1, description="pipeline micro-batches per step; default the number of stages"
    )
    seed: int = Field(0, ge=0, lt=2**63, description="seeds the sequences whose sampling params give none")
    speculative: Literal["mtp"] | None = Field(
        None, description="mtp: draft with the checkpoint's MTP layer, verify in the next step"
    )
    speculative_policy: Literal["auto", "always"] = Field(
        "auto",
        description="with speculative='mtp': auto drafts only where measured step times and acceptance "
        "say it pays at the running batch size (the reason logged on each change); always: every step",
    )
    allow_special_tokens_in_content: bool = Field(
        False,
        description="read special-token markup inside chat message content (<｜Assistant｜>) as control "
        "tokens; off: as the text it spells, so a message cannot forge another turn",
    )
    skip_tokenizer_init: bool = Field(
        False, description="load no tokenizer: prompts are token ids, outputs token ids without text"
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile the static decode step (fullgraph, one graph per batch bucket); "
        "auto: on for CUDA, off on the CPU, where each bucket's first step compiles for 6-17 s (then "
        "cached on disk), though the compiled step is faster there: 1.1-1.3x (docs/benchmarks.md)",
    )
    cuda_graphs: bool | None = Field(
        None, description="replay each batch bucket's decode step as a CUDA graph; default: on for CUDA"
    )
    cuda_graph_sizes: list[int] | None = Field(
        None,
        description="decode batch buckets (each >= 1); default 1, 2, 4, 8, then steps of 8 up to "
        "max_num_seqs. Larger decode batches run eager",
    )

    expert_load_window: int | None = Field(
        None,
        ge=1,
        description="record tokens routed to each expert over the last N steps (on the device, read "
        "every N steps: /metrics, launch eval and bench); default off, or eplb.window when eplb is on",
    )
    eplb: EplbConfig | None = Field(
        None, description="rebalance the routed experts over the EP ranks from measured load"
    )

    @property
    def load_window(self) -> int | None:
        """Steps of routed load the engine records; None: it records none."""
        return self.eplb.window if self.eplb is not None else self.expert_load_window

    @model_validator(mode="after")
    def _one_window(self) -> EngineConfig:
        eplb, window = self.eplb, self.expert_load_window
        if eplb is not None and window is not None and window != eplb.window:
            raise ValueError(
                f"expert_load_window={window} but eplb.window={eplb.window}: the engine records one "
                "window; set one of them, or both alike"
            )
        return self

    @model_validator(mode="after")
    def _graph_sizes(self) -> EngineConfig:
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1
        ):
            raise ValueError(
                f"cuda_graph_sizes={self.cuda_graph_sizes}: give batch sizes >= 1, or leave it unset"
            )
        return self


def default_kv_cache_fraction(device_type: str) -> float:
    """kv_cache_fraction when unset: on a GPU the memory left after the weights is the cache's (0.1 kept
    for the allocator and the step's buffers); the host's RAM is shared with everything else."""
    return 0.9 if device_type == "cuda" else 0.25
