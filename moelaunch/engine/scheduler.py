"""Continuous batching with chunked prefill over a paged cache, for one DP replica.

Every step: running sequences first (decodes cost one token each; an unfinished prompt continues),
oldest first; then waiting ones in arrival order while the token budget and free blocks last. A new
sequence reuses cached blocks of a shared prompt prefix. When blocks run out mid-step the youngest
running sequence is preempted: its blocks are released and it is recomputed later from its tokens.
With a sliding window, blocks that fall wholly behind it are released as the sequence advances.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelaunch.engine.block_manager import FREED, BlockManager
from moelaunch.engine.config import EngineConfig
from moelaunch.engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    length: int  # tokens computed this step, draft tokens included
    draft: tuple[int, ...] = ()  # speculative tokens appended after the sequence's last token

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so a next token is sampled."""
        return self.start + self.length - len(self.draft) == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.tokens[self.start : self.start + self.length - len(self.draft)] + list(self.draft)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.admitted_tokens = 0  # prompt tokens of admitted sequences (the prefix cache's queries)
        # Prefilled sequences admitted by the last schedule(), with the blocks of their prompt already
        # here (a prefix hit): the engine reads the rest from the prefill engine before the step runs.
        self.imports: list[tuple[Sequence, int]] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: s.seq_id)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        self.imports = []
        plan: list[ScheduledChunk] = []
        for seq in sorted(self.running, key=lambda s: s.seq_id):
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or out of budget
            n, draft = self._size(seq, seq.num_uncomputed, budget)
            if not self._grow(seq, seq.num_computed + n):
                continue
            plan.append(ScheduledChunk(seq, seq.num_computed, n, draft))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.pop(0)
            self.running.append(chunk.seq)
            plan.append(chunk)
            budget -= chunk.length
        return plan

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        cached: list[int] = []
        # A prefilled prompt arrives computed (its latents are read from the prefill engine); otherwise
        # leave at least one token to compute: its logits give the next token.
        known = len(seq.prompt) if seq.handoff else seq.num_tokens - 1
        if self.config.enable_prefix_caching:
            cached = self.blocks.match_prefix(seq.tokens[:known])
        n_cached = len(seq.prompt) if seq.handoff else len(cached) * self.blocks.block_size
        n, draft = self._size(seq, seq.num_tokens - n_cached, budget)
        fresh = self.blocks.blocks_needed(n_cached + n) - len(cached)
        if fresh > self.blocks.num_free - sum(self.blocks.blocks[b].ref_count == 0 for b in cached):
            return None
        self.blocks.acquire_cached(cached)
        seq.block_ids = cached + [self.blocks.allocate() for _ in range(fresh)]
        seq.block_hashes = self._chain(seq, len(cached))
        seq.num_computed = n_cached
        seq.status = SeqStatus.RUNNING
        self.admitted_tokens += seq.num_tokens
        if seq.handoff:
            self.imports.append((seq, len(cached)))
        return ScheduledChunk(seq, n_cached, n, draft)

    @staticmethod
    def _size(seq: Sequence, uncomputed: int, budget: int) -> tuple[int, tuple[int, ...]]:
        """Tokens to compute and the draft to verify: a chunk reaching the last token carries the
        sequence's draft (also after a preemption, so draws do not depend on scheduling)."""
        n = min(uncomputed, budget)
        draft = tuple(seq.draft[: budget - n]) if n == uncomputed else ()
        return n + len(draft), draft

    def _chain(self, seq: Sequence, n_blocks: int) -> list[int]:
        hashes, prev, size = [], None, self.blocks.block_size
        for b in range(n_blocks):
            prev = self.blocks.chain_hash(prev, tuple(seq.tokens[b * size : (b + 1) * size]))
            hashes.append(prev)
        return hashes

    def _grow(self, seq: Sequence, n_tokens: int) -> bool:
        """Give `seq` blocks for n_tokens, preempting the youngest others; False if seq itself went."""
        while len(seq.block_ids) < self.blocks.blocks_needed(n_tokens):
            if self.blocks.num_free == 0:
                victim = max(
                    (s for s in self.running if s.status is SeqStatus.RUNNING), key=lambda s: s.seq_id
                )
                self.preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.block_ids.append(self.blocks.allocate())
        return True

    def preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_ids)
        seq.reset_for_recompute()
        self.running.remove(seq)
        self.add(seq)
        self.preemptions += 1

    def computed(self, chunk: ScheduledChunk, accepted_drafts: int = 0) -> None:
        """After a step (and after the sampled tokens joined the sequence): the chunk's latents up to
        the last kept draft token are valid; seal the blocks they filled for prefix reuse."""
        seq = chunk.seq
        seq.num_computed = chunk.start + chunk.length - len(chunk.draft) + accepted_drafts
        size = self.blocks.block_size
        while len(seq.block_hashes) < seq.num_computed // size:
            b = len(seq.block_hashes)
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.tokens[b * size : (b + 1) * size])
            seq.block_hashes.append(self.blocks.seal(seq.block_ids[b], prev, tokens))
        self._drop_out_of_window(seq)

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """With a sliding window, give back the blocks before the first position the sequence's next
        query can see: no later query reads them. They were sealed first, so a prompt with the same
        prefix can still hit them until they are reused (a block's latents depend only on the tokens up
        to it, so reference counts are all the sharing needs)."""
        window = self.config.attention.window
        if window is None:
            return
        dead = max(0, seq.num_computed - window) // self.blocks.block_size
        for b in range(dead):
            if seq.block_ids[b] != FREED:
                self.blocks.release([seq.block_ids[b]])
                seq.block_ids[b] = FREED

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.blocks.release(seq.block_ids)
        seq.block_ids = []
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
