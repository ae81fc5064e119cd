"""Block allocation for the paged latent cache, with prefix caching.

A full block is identified by the hash of its tokens and of every token before it, so two requests
with the same prompt prefix map it to the same physical block (reference-counted). Freed blocks that
hold a full hashed prefix stay findable until their memory is needed (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# A sequence's block-table entry for a block it no longer holds (sliding window); never read.
FREED = -1


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full


@dataclass
class BlockStats:
    prefix_hit_tokens: int = 0
    evictions: int = 0


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    blocks: list[Block] = field(init=False)
    free_ids: OrderedDict[int, None] = field(init=False)  # in order of reuse (oldest freed first)
    by_hash: dict[int, int] = field(init=False)
    stats: BlockStats = field(default_factory=BlockStats)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_ids = OrderedDict((i, None) for i in range(self.num_blocks))
        self.by_hash = {}

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    @staticmethod
    def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Ids of cached blocks holding the longest run of full blocks that starts `tokens`."""
        found, prev = [], None
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            prev = self.chain_hash(prev, tuple(tokens[start : start + self.block_size]))
            block_id = self.by_hash.get(prev)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def acquire_cached(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_ids.pop(block_id)
            block.ref_count += 1
        self.stats.prefix_hit_tokens += len(block_ids) * self.block_size

    def allocate(self) -> int:
        """A fresh block; evicts the least recently freed cached prefix if it must."""
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self.by_hash.pop(block.hash, None)
            block.hash = None
            self.stats.evictions += 1
        block.ref_count = 1
        return block_id

    def seal(self, block_id: int, prev_hash: int | None, tokens: tuple[int, ...]) -> int:
        """Mark a just-filled block as holding `tokens` after the prefix `prev_hash`; returns its hash."""
        h = self.chain_hash(prev_hash, tokens)
        block = self.blocks[block_id]
        if h not in self.by_hash:
            self.by_hash[h] = block_id
            block.hash = h
        return h

    def release(self, block_ids: list[int]) -> None:
        """Give blocks back; ids < 0 (FREED: left behind by a sliding window, already given back) are
        skipped."""
        for block_id in reversed(block_ids):  # a sequence's tail is the least likely to be shared again
            if block_id < 0:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None
