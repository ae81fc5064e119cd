"""The latent KV cache of MLA: per token and layer only c_kv (kv_lora_rank) and rotated k_pe (rope dim)."""

from __future__ import annotations

import torch

from .config import ModelArgs


class LatentCache:
    """Contiguous per-sequence cache for `batch` sequences of up to `max_len` tokens.

    `layer_ids` are the (global) layers it stores, by default all main layers; a pipeline stage
    passes only its own.
    """

    def __init__(
        self,
        args: ModelArgs,
        batch: int,
        max_len: int,
        layer_ids: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        layer_ids = list(range(args.num_hidden_layers)) if layer_ids is None else layer_ids
        self.slot = {layer: i for i, layer in enumerate(layer_ids)}
        n_layers = len(layer_ids)
        self.max_len = max_len
        self.kv = torch.zeros(n_layers, batch, max_len, args.kv_lora_rank, dtype=dtype, device=device)
        self.pe = torch.zeros(n_layers, batch, max_len, args.qk_rope_head_dim, dtype=dtype, device=device)

    def write(
        self, layer: int, row: int, start: int, kv: torch.Tensor, pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one sequence's chunk kv [T, rank], pe [T, rope] at positions [start, start+T) of
        cache row `row`, and return that row's entries up to the chunk's end."""
        end = start + kv.shape[0]
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache's max_len={self.max_len}")
        i = self.slot[layer]
        self.kv[i, row, start:end] = kv
        self.pe[i, row, start:end] = pe
        return self.kv[i, row, :end], self.pe[i, row, :end]

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.kv.shape[-1] + self.pe.shape[-1]
        return per_layer * self.kv.shape[0] * self.kv.element_size()
