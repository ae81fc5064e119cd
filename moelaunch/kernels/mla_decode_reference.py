"""Plain-torch reference for paged MLA decode attention in the absorbed (latent-space) form.

It defines the numerics the Triton kernel must reproduce and is the CPU path of the dispatcher: every query
row attends to its own prefix of a paged latent cache, scores and softmax in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelaunch.kernels.kv_fp8 import dequantize_latent


def _gather_paged_tokens(
    cache: Tensor, block_table: Tensor, seq_lens: Tensor, starts: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's cached tokens starts[r]..seq_lens[r]-1 in order, padded to what the block table can
    hold: ([R, S_max, C + P] as stored, their (block, slot) indices ([R, S_max] each) for reading scales,
    mask [R, S_max]). S_max comes from shapes, not values: no host sync, the same for every step whose
    table has this width.

    Slots outside a row's range are never read: their block ids may be -1 or out of range, and the slots
    themselves may hold anything (a partial last block's tail is uninitialized memory, possibly NaN).
    """
    block_size = cache.shape[1]
    starts = starts.long()
    s_max = block_table.shape[1] * block_size
    pos = starts[:, None] + torch.arange(s_max, device=cache.device)[None, :]
    valid = pos < seq_lens[:, None].long()
    columns = (pos // block_size).masked_fill(~valid, 0)
    block_ids = block_table.long().gather(1, columns).masked_fill(~valid, 0)
    slots = pos % block_size
    return cache[block_ids, slots], (block_ids, slots), valid


def paged_mla_decode_ref(
    q_latent: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    cache_scales: Tensor | None = None,
    starts: Tensor | None = None,
) -> Tensor:
    """softmax(scale * (q_latent . c + q_pe . k_pe)) @ c over each row's tokens starts[r]..seq_lens[r]-1.

    q_latent [R, H, C], q_pe [R, H, P], cache [num_blocks, block_size, C + P] holding [c | k_pe] per token,
    block_table [R, max_blocks], seq_lens [R] (>= 1) -> [R, H, C] in q_latent.dtype. An fp8 cache comes
    with cache_scales [num_blocks, block_size, 2] (see `kv_fp8`); starts [R] (default 0, each
    < seq_lens) drops every token before it (a sliding window).
    """
    c_dim = q_latent.shape[-1]
    if starts is None:
        starts = torch.zeros_like(seq_lens)
    tokens, (block_ids, slots), valid = _gather_paged_tokens(cache, block_table, seq_lens, starts)
    if cache_scales is None:
        tokens = tokens.float()
    else:
        tokens = dequantize_latent(tokens, cache_scales[block_ids, slots], c_dim)
    # Padding slots read a slot of block 0 (and its scales), which may hold anything: zero them.
    tokens = tokens.masked_fill(~valid[..., None], 0)
    c, k_pe = tokens.split([c_dim, tokens.shape[-1] - c_dim], dim=-1)
    scores = torch.einsum("rhc,rsc->rhs", q_latent.float(), c)
    scores = scores + torch.einsum("rhp,rsp->rhs", q_pe.float(), k_pe)
    probs = (scores * scale).masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("rhs,rsc->rhc", probs, c).to(q_latent.dtype)
