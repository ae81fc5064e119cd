"""How one forward pass's tokens are laid out: sequences of different lengths flattened into [N].

Linear layers and experts run on all N tokens at once; attention walks the spans, each reading its
own sequence from the paged cache through its block-table row. A rank with no tokens runs the same
pass with N = 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from moelaunch.model.kv_cache import PagedLatentCache


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's tokens in the flat batch: rows [offset, offset + length), positions from start_pos."""

    offset: int
    length: int
    start_pos: int

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.length


@dataclass(frozen=True)
class DecodeRows:
    """The rows of a layout that attend together through the paged decode kernel: its single-token spans
    (decodes), or under top-k block attention every token. The same for every layer of a forward pass,
    so built once per pass."""

    spans: list[int]  # indices into BatchLayout.spans
    rows: torch.Tensor  # [R] their token rows
    seq_lens: torch.Tensor  # [R] cached tokens each attends over, its own included
    block_tables: torch.Tensor  # [R, max_blocks]
    every_row: bool  # the pass is decodes only, rows == 0..N-1 (no gather or scatter needed)


@dataclass
class BatchLayout:
    spans: list[SeqSpan]
    positions: torch.Tensor  # [N] absolute position of every token
    cache: PagedLatentCache | None = None
    block_tables: torch.Tensor | None = None  # [len(spans), max_blocks] block ids per span
    slots: torch.Tensor | None = None  # [N] flat cache slot of every token

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    @cached_property
    def decode_rows(self) -> DecodeRows | None:
        """The decodes, when there is a cache and at least one; None otherwise."""
        if self.cache is None or self.block_tables is None:
            return None
        device = self.positions.device
        if self._topk_cuts_a_prompt():
            # Top-k block attention picks blocks per query, so every token of a prompt chunk attends as a
            # decode row does, over its own prefix: each row's length is its position + 1.
            lengths = torch.tensor([s.length for s in self.spans], device=device)
            span_of_token = torch.repeat_interleave(torch.arange(len(self.spans), device=device), lengths)
            rows = torch.arange(self.n_tokens, device=device)
            return DecodeRows(
                list(range(len(self.spans))), rows, self.positions + 1, self.block_tables[span_of_token], True
            )
        spans = [i for i, s in enumerate(self.spans) if s.length == 1]
        if not spans:
            return None
        every_row = len(spans) == len(self.spans) and all(self.spans[i].offset == i for i in spans)
        rows = torch.tensor([self.spans[i].offset for i in spans], device=device)
        seq_lens = torch.tensor([self.spans[i].end_pos for i in spans], device=device)
        tables = self.block_tables if every_row else self.block_tables[torch.tensor(spans, device=device)]
        return DecodeRows(spans, rows, seq_lens, tables, every_row)

    def _topk_cuts_a_prompt(self) -> bool:
        """Whether top-k block attention is on and could drop blocks of a multi-token span (one whose
        rows may have more than K full blocks before their own)."""
        k = self.cache.sparse.topk_blocks
        return k is not None and any(s.length > 1 for s in self.spans) and self.block_tables.shape[1] - 1 > k

    @classmethod
    def build(
        cls,
        spans: list[SeqSpan],
        cache: PagedLatentCache | None = None,
        block_tables: list[list[int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> BatchLayout:
        pos = [torch.arange(s.start_pos, s.end_pos) for s in spans]
        positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)
        if cache is None:
            return cls(spans, positions.to(device))
        width = max((len(row) for row in block_tables), default=1)
        tables = torch.tensor([row + [0] * (width - len(row)) for row in block_tables], dtype=torch.long)
        tables = tables.view(len(spans), width)
        span_of_token = torch.repeat_interleave(
            torch.arange(len(spans)), torch.tensor([s.length for s in spans], dtype=torch.long)
        )
        blocks = tables[span_of_token, positions // cache.block_size]
        slots = blocks * cache.block_size + positions % cache.block_size
        return cls(spans, positions.to(device), cache, tables.to(device), slots.to(device))

    @classmethod
    def rectangle(
        cls,
        batch: int,
        length: int,
        start_pos: int,
        cache: PagedLatentCache | None,
        device: torch.device | str,
    ) -> BatchLayout:
        """`batch` sequences of `length` tokens each; with a cache, sequence b owns its block b."""
        spans = [SeqSpan(b * length, length, start_pos) for b in range(batch)]
        tables = [[b] for b in range(batch)] if cache is not None else None
        return cls.build(spans, cache, tables, device)
