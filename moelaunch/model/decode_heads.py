"""The weights of the absorbed MLA form's two per-head products at decode (`kernels.per_head_linear`).

q_latent[r, h] = q_nope[r, h] @ W_UK[h] and out[r, h] = latent[r, h] @ W_UV[h]^T are, per head, a
few-row linear layer; as einsums they became one batched GEMM per product whose small-M path cost more
than the rest of the layer at batch 1 (profiled on the bench model: 60-170 us per call for 260 k
multiply-adds). As heads = groups of the grouped kernel they read each head's weight once, as stored.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DecodeHeadWeights:
    """W_UK and W_UV [H, *, C] in the form a decode path reads them, made once per dtype from kv_b_proj's
    weight (and again only if that weight is replaced): a copy of kv_b's size, in that dtype.

    per_head_stacks: W_UK^T [H, C, nope] and W_UV [H, v, C] as contiguous stacks for `per_head_linear`;
    else W_UK [H, nope, C] and W_UV [H, v, C], contiguous, for the einsums of the many-row path, whose
    fp32 rows under bf16 weights (the CPU's bf16) would otherwise convert both on every step, or gather
    the strided slices of kv_b (the bf16 GEMM's copy of each)."""

    def __init__(self, per_head_stacks: bool = True) -> None:
        self.per_head_stacks = per_head_stacks
        self._key: tuple[torch.dtype, int] | None = None
        self._stacks: tuple[Tensor, Tensor] | None = None

    def get(self, w_uk: Tensor, w_uv: Tensor, source: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """w_uk [H, nope, C] and w_uv [H, v, C] (views of `source`, the kv_b weight), wanted in `dtype`."""
        if torch.compiler.is_compiling():
            # A traced step cannot key a cache on data pointers: it reads the stacks an eager step made
            # for this dtype (StaticDecode.prime runs one before compiling), so a step compiled before
            # kv_b's weight is replaced keeps the old ones, as Linear.dense_weight does. Without them
            # the graph makes the stacks on every call (a kv_b-sized copy a step: ~10% of a batch-1
            # step on the bench model).
            if self._stacks is not None and self._key is not None and self._key[0] == dtype:
                return self._stacks
            return self._made(w_uk.to(dtype), w_uv.to(dtype))
        key = (dtype, source.data_ptr())
        if self._stacks is None or self._key != key:
            self._key = key
            self._stacks = self._made(w_uk.to(dtype), w_uv.to(dtype))
        return self._stacks

    def _made(self, w_uk: Tensor, w_uv: Tensor) -> tuple[Tensor, Tensor]:
        if self.per_head_stacks:
            return w_uk.transpose(1, 2).contiguous(), w_uv.contiguous()
        return w_uk.contiguous(), w_uv.contiguous()
