"""How one forward pass's tokens are laid out: sequences of different lengths flattened into [N].

Linear layers and experts run on all N tokens at once; attention walks the spans, each reading its
own sequence from the paged cache through its block-table row. A rank with no tokens runs the same
pass with N = 0.
"""

from __future__ import annotations

import itertools
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


# Spans up to this many tokens attend as decode rows: speculative verification spans (the last token and
# its drafts) are this short, and so batch with the decodes instead of attending one span at a time.
DECODE_SPAN_MAX = 4


@dataclass(frozen=True)
class DecodeRows:
    """The rows of a layout that attend together through the paged decode kernel (see
    BatchLayout.decode_rows). The same for every layer of a forward pass, so built once per pass."""

    spans: list[int]  # indices into BatchLayout.spans, all of whose tokens are rows here
    rows: torch.Tensor  # [R] their token rows
    seq_lens: torch.Tensor  # [R] cached tokens each attends over, its own included
    block_tables: torch.Tensor  # [R, max_blocks], or one per run of rows_per_table
    every_row: bool  # the pass is decodes only, rows == 0..N-1 (no gather or scatter needed)
    # Multi-token spans: their rows in runs that share one table each, so that a long prompt's tokens
    # do not each copy the whole table. None: one table per row.
    rows_per_table: list[int] | None = None


@dataclass
class BatchLayout:
    spans: list[SeqSpan]
    positions: torch.Tensor  # [N] absolute position of every token
    cache: PagedLatentCache | None = None
    block_tables: torch.Tensor | None = None  # [len(spans), max_blocks] block ids per span
    slots: torch.Tensor | None = None  # [N] flat cache slot of every token
    static: bool = False  # a static decode step: device values only, shapes fixed by the batch bucket
    valid_rows: torch.Tensor | None = None  # [N] bool: a static step's rows that are not bucket padding

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])

    @cached_property
    def decode_rows(self) -> DecodeRows | None:
        """The rows that attend as decodes (each token over its own prefix, all in one kernel call): the
        tokens of spans up to DECODE_SPAN_MAX long, or of every span under top-k block attention (which
        selects blocks per query). None without a cache or such a span."""
        if self.cache is None or self.block_tables is None:
            return None
        limit = self.n_tokens if self._topk_cuts_a_prompt() else DECODE_SPAN_MAX
        spans = [i for i, s in enumerate(self.spans) if s.length <= limit]
        if not spans:
            return None
        device = self.positions.device
        chosen = [self.spans[i] for i in spans]
        offsets = [s.offset for s in chosen]
        every_row = len(spans) == len(self.spans) and offsets == list(
            itertools.accumulate([0, *[s.length for s in chosen[:-1]]])
        )
        if all(s.length == 1 for s in chosen):  # plain decodes: the common case, built without gathers
            rows = torch.tensor(offsets, device=device)
            seq_lens = torch.tensor([s.end_pos for s in chosen], device=device)
            tables = self.block_tables if every_row else self.block_tables[torch.tensor(spans, device=device)]
            return DecodeRows(spans, rows, seq_lens, tables, every_row)
        rows = torch.cat([torch.arange(s.offset, s.offset + s.length) for s in chosen]).to(device)
        tables = self.block_tables[torch.tensor(spans, device=device)]
        lengths = [s.length for s in chosen]
        return DecodeRows(spans, rows, self.positions[rows] + 1, tables, every_row, lengths)

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
        if all(s.length == 1 for s in spans):  # decodes (or none): one op, not an arange per sequence
            positions = torch.tensor([s.start_pos for s in spans], dtype=torch.long)
        else:
            positions = torch.cat([torch.arange(s.start_pos, s.end_pos) for s in spans])
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
    def static_decode(
        cls,
        positions: torch.Tensor,
        cache: PagedLatentCache,
        block_tables: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        mark_padding: bool = False,
    ) -> BatchLayout:
        """A decode-only batch of one token per row whose positions, tables, slots and lengths are
        device tensors nothing reads back: the static decode step. Its spans give row offsets only
        (start_pos is not known on the host); every layer takes the decode rows as they are.
        mark_padding: set valid_rows (for the routed-load count, which must leave padding out)."""
        n = positions.shape[0]
        spans = [SeqSpan(i, 1, 0) for i in range(n)]
        # Padding rows write to the scratch block, which no sequence owns.
        valid = slots // cache.block_size != cache.scratch_block if mark_padding else None
        layout = cls(spans, positions, cache, block_tables, slots, static=True, valid_rows=valid)
        rows = torch.arange(n, device=positions.device)
        layout.decode_rows = DecodeRows(list(range(n)), rows, seq_lens, block_tables, every_row=True)
        return layout

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
