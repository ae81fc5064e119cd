"""The latent KV cache of MLA, paged: per token and layer only [c_kv | k_pe] (kv_lora_rank + rope
dim values, 576 for DeepSeek-V3), in fixed-size blocks that sequences address through block tables.

A contiguous per-sequence cache is the special case of one block per sequence (block_size = max_len,
sequence b in block b), which is what the rectangular `Transformer.forward` API uses.

Optionally the values are stored in fp8 e4m3 with two fp32 scales per token (`kernels.kv_fp8`): half the
bytes of bf16, so twice the tokens in the same memory. `SparseAttention` limits which cached tokens a
query sees; both of its modes are approximations of the model's full attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moelaunch import kernels
from moelaunch.model.config import ModelArgs


@dataclass(frozen=True)
class SparseAttention:
    """Approximations of full causal attention over the paged cache (None: off). At most one is set.

    window: a query at position p attends to positions p - window .. p only, in prefill and decode;
    the engine frees the blocks every later query has left behind.
    topk_blocks: a query attends to the K full blocks whose mean latent scores highest against it (the
    best over its heads; by linearity, the mean of the block's scores) plus its own, latest block; in
    prefill and speculative verification every token selects its own blocks, as a decode query does.
    """

    window: int | None = None
    topk_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.topk_blocks is not None:
            raise ValueError("give window or topk_blocks, not both (they are alternatives)")

    def first_visible(self, pos: int) -> int:
        """The first position a query at `pos` attends to."""
        return max(0, pos - self.window) if self.window is not None else 0


# Working memory for top-k block selection at a time (see PagedLatentCache._select_blocks).
SELECT_BYTES = 256 * 2**20


class PagedLatentCache:
    def __init__(
        self,
        args: ModelArgs,
        num_blocks: int,
        block_size: int,
        layer_ids: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fp8: bool = False,
        sparse: SparseAttention | None = None,
        heads_max: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    ) -> None:
        """dtype: what values are read back as (stored as such, or dequantized from fp8 when fp8);
        heads_max: the maximum over every rank's heads of a per-rank maximum (identity in one process)."""
        self.heads_max = heads_max
        layer_ids = list(range(args.num_hidden_layers)) if layer_ids is None else layer_ids
        self.slot_of_layer = {layer: i for i, layer in enumerate(layer_ids)}
        self.kv_rank = args.kv_lora_rank
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.sparse = sparse or SparseAttention()
        width = args.kv_lora_rank + args.qk_rope_head_dim
        n = len(layer_ids)
        storage = kernels.FP8_KV_DTYPE if fp8 else dtype
        # One block past the num_blocks handed out: the rows a static decode step pads its batch with
        # write and read there, so they touch no sequence's tokens.
        self.scratch_block = num_blocks
        held = num_blocks + 1
        # Uninitialized: a slot is always written before any read covers it, and untouched pages of a
        # large CPU pool then cost no memory.
        self.pool = torch.empty(n, held, block_size, width, dtype=storage, device=device)
        shape = (n, held, block_size, kernels.SCALES_PER_TOKEN)
        self.scales = torch.empty(shape, dtype=torch.float32, device=device) if fp8 else None
        # Top-k block selection scores each full block by its mean latent, computed when the block fills.
        topk = self.sparse.topk_blocks is not None
        self.block_means = torch.empty(n, held, width, device=device) if topk else None

    @staticmethod
    def bytes_per_token(args: ModelArgs, n_layers: int, dtype: torch.dtype, fp8: bool = False) -> int:
        width = args.kv_lora_rank + args.qk_rope_head_dim
        if fp8:
            return (width + kernels.SCALES_PER_TOKEN * 4) * n_layers
        return width * n_layers * torch.finfo(dtype).bits // 8

    @classmethod
    def bytes_per_block(
        cls,
        args: ModelArgs,
        n_layers: int,
        block_size: int,
        dtype: torch.dtype,
        fp8: bool = False,
        sparse: SparseAttention | None = None,
    ) -> int:
        """What one block costs, its top-k summary (one fp32 mean latent per layer) included."""
        tokens = block_size * cls.bytes_per_token(args, n_layers, dtype, fp8)
        topk = sparse is not None and sparse.topk_blocks is not None
        return tokens + (args.kv_lora_rank + args.qk_rope_head_dim) * 4 * n_layers * topk

    def store(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """Write tokens' latents ([N, C + P]) at flat slots (block * block_size + offset)."""
        i = self.slot_of_layer[layer]
        if self.scales is None:
            kernels.store_rows(self.pool, i, slots, latent.to(self.pool.dtype))
        else:
            kernels.store_fp8_latent(self.pool, self.scales, i, slots, latent, self.kv_rank)
        if self.block_means is not None:
            # A block is full once its last slot is written (slots fill in order; a rejected speculative
            # token is rewritten before any later slot, so the mean is taken over the final values).
            filled = slots[slots % self.block_size == self.block_size - 1] // self.block_size
            self.block_means[i, filled] = self._read(i, filled, torch.float32).mean(dim=1)

    def refresh_block_means(self, blocks: list[int]) -> None:
        """Recompute top-k's block summaries of full blocks written by a copy rather than store()."""
        if self.block_means is None or not blocks:
            return
        ids = torch.tensor(blocks, device=self.pool.device)
        for i in range(self.pool.shape[0]):
            self.block_means[i, ids] = self._read(i, ids, torch.float32).mean(dim=1)

    def _read(
        self, i: int, blocks: torch.Tensor, dtype: torch.dtype, rows: slice = slice(None)
    ) -> torch.Tensor:
        """Blocks of layer slot i as values: [len(blocks), rows of block_size, C + P] in dtype."""
        scales = self.scales[i, blocks, rows] if self.scales is not None else None
        return self._values(self.pool[i, blocks, rows], scales, dtype)

    def _values(self, stored: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows [..., C + P] as values in dtype: an fp8 pool's codes times their scales."""
        if scales is None:
            return stored.to(dtype)
        return kernels.read_fp8_latent(stored, scales, self.kv_rank, dtype)

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens stored at flat slots (as `store` takes them) as (kv [N, C], pe [N, P]) in
        self.dtype: what `gather` reads for them."""
        i, width = self.slot_of_layer[layer], self.pool.shape[-1]
        scales = self.scales[i].view(-1, 2)[slots] if self.scales is not None else None
        latent = self._values(self.pool[i].view(-1, width)[slots], scales, self.dtype)
        return latent[:, : self.kv_rank], latent[:, self.kv_rank :]

    def gather(
        self, layer: int, block_row: torch.Tensor, length: int, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's cached tokens start..length-1 as contiguous (kv [L, C], pe [L, P]) in self.dtype;
        blocks before `start`'s (freed by a sliding window) are not read."""
        first_block = start // self.block_size
        n_blocks = -(-length // self.block_size)
        skip = first_block * self.block_size
        blocks = block_row[first_block:n_blocks]
        if blocks.shape[0] == 1:
            # One block holds the range (always so in a contiguous cache, whose block is the whole
            # sequence): copy just its rows, not the block.
            latent = self._read(
                self.slot_of_layer[layer], blocks, self.dtype, slice(start - skip, length - skip)
            )
            latent = latent[0]
        else:
            latent = self._read(self.slot_of_layer[layer], blocks, self.dtype).flatten(0, 1)
            latent = latent[start - skip : length - skip]
        return latent[:, : self.kv_rank], latent[:, self.kv_rank :]

    def decode(
        self,
        layer: int,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        rows_per_table: list[int] | None = None,
    ) -> torch.Tensor:
        """Absorbed-form attention of single query rows over their cached sequences: [R, H, C].
        rows_per_table: the rows come in runs sharing one table (a prompt's tokens), block_tables holding
        one row per run; None: one table per row."""
        i = self.slot_of_layer[layer]
        # The table's width bounds every row's length on the host: when no row can reach past the window
        # or hold more than K full blocks, attention is full and takes the exact unlimited path.
        longest = block_tables.shape[1] * self.block_size
        window, topk = self.sparse.window, self.sparse.topk_blocks
        starts = None
        if window is not None and longest - 1 > window:
            starts = (seq_lens - 1 - window).clamp(min=0)
        if topk is not None and block_tables.shape[1] - 1 > topk:
            block_tables, seq_lens = self._select_blocks(
                i, q_latent, q_pe, block_tables, seq_lens, topk, rows_per_table
            )
        elif rows_per_table is not None:
            counts = torch.tensor(rows_per_table, device=block_tables.device)
            block_tables = block_tables.repeat_interleave(counts, dim=0)
        scales = self.scales[i] if self.scales is not None else None
        cache = self.pool[i]
        return kernels.paged_mla_decode(
            q_latent, q_pe, cache, block_tables, seq_lens, scale, scales, starts, fp8_as=self.dtype
        )

    def _select_blocks(
        self,
        i: int,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        k: int,
        rows_per_table: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's K best full blocks (in position order) then its latest block, as a compacted block
        table [R, K + 1] and the lengths it covers. Positions need not be contiguous: RoPE is already in
        the cached k_pe, so attention over the kept tokens is the same wherever they sit."""
        n_full = (seq_lens.long() - 1) // self.block_size  # the row's query sits in block n_full
        column = torch.arange(block_tables.shape[1] - 1, device=block_tables.device)
        chosen = []
        # Rows a few at a time: a prompt's every token selects its own blocks, and all of its rows'
        # scores ([rows, heads, blocks]) would not fit at long lengths.
        for rows, scores in self._scored_slices(i, q_latent, q_pe, block_tables, rows_per_table):
            visible = column[None, :] < n_full[rows, None]
            scores = self.heads_max(scores).masked_fill(~visible, float("-inf"))
            # Real blocks outrank the -inf ones, so a row with at most K full blocks keeps them all.
            chosen.append(scores.topk(k, dim=1).indices.sort(dim=1).values)
        chosen = torch.cat(chosen) if len(chosen) != 1 else chosen[0]
        kept = n_full.clamp(max=k)
        slot = torch.arange(k + 1, device=block_tables.device)[None, :]
        padded = torch.cat([chosen, chosen[:, :1]], dim=1)  # the last column always takes n_full
        columns = torch.where(slot < kept[:, None], padded, n_full[:, None])
        if rows_per_table is None:
            tables = block_tables.long().gather(1, columns)
        else:  # index the runs' tables without a [rows, blocks] copy of them
            counts = torch.tensor(rows_per_table, device=block_tables.device)
            table_of_row = torch.arange(len(rows_per_table), device=counts.device).repeat_interleave(counts)
            tables = block_tables.long()[table_of_row[:, None], columns]
        return tables, seq_lens - (n_full - kept) * self.block_size

    def _scored_slices(
        self,
        i: int,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        block_tables: torch.Tensor,
        rows_per_table: list[int] | None,
    ) -> Iterator[tuple[slice, torch.Tensor]]:
        """(rows, [rows, blocks] best head score against each candidate block's mean latent), over
        slices of at most SELECT_BYTES of working memory. Rows that share a table (a prompt's tokens) are
        scored against its means gathered once, as one product; others each against their own."""
        candidates = block_tables[:, :-1].long()
        heads, width = q_latent.shape[1], self.block_means.shape[-1]
        if rows_per_table is None:  # per row: its gathered means and its scores
            step = max(1, SELECT_BYTES // max(candidates.shape[1] * (width + heads) * 4, 1))
            for r in range(0, candidates.shape[0], step):
                rows = slice(r, r + step)
                means = self.block_means[i, candidates[rows]]  # [R, B, C + P]
                scores = torch.einsum("rhc,rbc->rhb", q_latent[rows].float(), means[..., : self.kv_rank])
                scores = scores + torch.einsum("rhp,rbp->rhb", q_pe[rows].float(), means[..., self.kv_rank :])
                yield rows, scores.amax(dim=1)
            return
        step = max(1, SELECT_BYTES // max(candidates.shape[1] * heads * 4, 1))
        first = 0
        for table, n_rows in zip(candidates, rows_per_table, strict=True):
            means = self.block_means[i, table]  # [B, C + P], once for every row of the run
            latent_t, pe_t = means[:, : self.kv_rank].T, means[:, self.kv_rank :].T
            for r in range(first, first + n_rows, step):
                rows = slice(r, min(r + step, first + n_rows))
                scores = q_latent[rows].float() @ latent_t + q_pe[rows].float() @ pe_t  # [R, H, B]
                yield rows, scores.amax(dim=1)
            first += n_rows
