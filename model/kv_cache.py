"""The latent KV cache of MLA, paged: per token and layer only [c_kv | k_pe] (kv_lora_rank + rope
dim values, 576 for DeepSeek-V3), in fixed-size blocks that sequences address through block tables.

A contiguous per-sequence cache is the special case of one block per sequence (block_size = max_len,
sequence b in block b), which is what the rectangular `Transformer.forward` API uses.
"""

from __future__ import annotations

import torch

from moelaunch import kernels
from moelaunch.model.config import ModelArgs


class PagedLatentCache:
    def __init__(
        self,
        args: ModelArgs,
        num_blocks: int,
        block_size: int,
        layer_ids: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        layer_ids = list(range(args.num_hidden_layers)) if layer_ids is None else layer_ids
        self.slot_of_layer = {layer: i for i, layer in enumerate(layer_ids)}
        self.kv_rank = args.kv_lora_rank
        self.block_size = block_size
        self.num_blocks = num_blocks
        width = args.kv_lora_rank + args.qk_rope_head_dim
        # Uninitialized: a slot is always written before any read covers it, and untouched pages of a
        # large CPU pool then cost no memory.
        self.pool = torch.empty(len(layer_ids), num_blocks, block_size, width, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(args: ModelArgs, n_layers: int, dtype: torch.dtype) -> int:
        return (args.kv_lora_rank + args.qk_rope_head_dim) * n_layers * torch.finfo(dtype).bits // 8

    def store(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """Write tokens' latents ([N, C + P]) at flat slots (block * block_size + offset)."""
        flat = self.pool[self.slot_of_layer[layer]].view(-1, self.pool.shape[-1])
        flat.index_copy_(0, slots, latent.to(flat.dtype))

    def gather(self, layer: int, block_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `length` cached tokens as contiguous (kv [L, C], pe [L, P])."""
        n_blocks = -(-length // self.block_size)
        latent = self.pool[self.slot_of_layer[layer], block_row[:n_blocks]].flatten(0, 1)[:length]
        return latent[:, : self.kv_rank], latent[:, self.kv_rank :]

    def decode(
        self,
        layer: int,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Absorbed-form attention of single query rows over their cached sequences: [R, H, C]."""
        cache = self.pool[self.slot_of_layer[layer]]
        return kernels.paged_mla_decode(q_latent, q_pe, cache, block_tables, seq_lens, scale)
