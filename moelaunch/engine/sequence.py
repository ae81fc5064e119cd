"""One sequence being generated: its tokens, its place in the paged cache, and how far it got."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moelaunch.engine.constraints import SequenceConstraints
from moelaunch.engine.kv_handoff import KVHandoff
from moelaunch.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int  # engine-wide, in arrival order: preemption picks the youngest (largest)
    request_id: str
    index: int  # which of the request's n samples
    prompt: list[int]
    params: SamplingParams
    seed: int  # keys its draws with each token's position (moelaunch.model.sampling.uniform)
    output: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hash of each full block
    num_computed: int = 0  # tokens whose latents are in the cache
    finish_reason: str | None = None
    draft: list[int] = field(default_factory=list)  # MTP's guess of the tokens after the last one
    # Whether the MTP layer runs over this sequence (its cache then has every position) and it drafts;
    # once off, off for its lifetime (engine/draft_policy.py).
    drafts: bool = True
    constraints: SequenceConstraints | None = None  # bad words and grammar, made by the sampler
    handoff: KVHandoff | None = None  # a prompt another engine prefilled: its latents are read, not computed

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def reset_for_recompute(self) -> None:
        self.status = SeqStatus.WAITING
        self.block_ids, self.block_hashes, self.num_computed = [], [], 0  # the draft stays valid
