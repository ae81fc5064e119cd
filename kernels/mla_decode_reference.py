"""Plain-torch reference for paged MLA decode attention in the absorbed (latent-space) form.

It defines the numerics the Triton kernel must reproduce and is the CPU path of the dispatcher: every query
row attends to its own prefix of a paged latent cache, scores and softmax in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _gather_paged_tokens(cache: Tensor, block_table: Tensor, seq_lens: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's cached tokens in order, zero-padded to the longest: ([R, S_max, C + P], mask [R, S_max]).

    Slots past a row's length are never read: their block ids may be -1 or out of range, and the slots
    themselves may hold anything (a partial last block's tail is uninitialized memory, possibly NaN).
    """
    block_size = cache.shape[1]
    s_max = int(seq_lens.max())
    pos = torch.arange(s_max, device=cache.device)
    valid = pos[None, :] < seq_lens[:, None].long()
    block_ids = block_table[:, pos // block_size].long().masked_fill(~valid, 0)
    tokens = cache[block_ids, pos % block_size].masked_fill(~valid[..., None], 0)
    return tokens, valid


def paged_mla_decode_ref(
    q_latent: Tensor, q_pe: Tensor, cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """softmax(scale * (q_latent . c + q_pe . k_pe)) @ c over each row's tokens 0..seq_lens[r]-1.

    q_latent [R, H, C], q_pe [R, H, P], cache [num_blocks, block_size, C + P] holding [c | k_pe] per token,
    block_table [R, max_blocks], seq_lens [R] (>= 1) -> [R, H, C] in q_latent.dtype.
    """
    c_dim = q_latent.shape[-1]
    tokens, valid = _gather_paged_tokens(cache, block_table, seq_lens)
    c, k_pe = tokens.float().split([c_dim, tokens.shape[-1] - c_dim], dim=-1)
    scores = torch.einsum("rhc,rsc->rhs", q_latent.float(), c)
    scores = scores + torch.einsum("rhp,rsp->rhs", q_pe.float(), k_pe)
    probs = (scores * scale).masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("rhs,rsc->rhc", probs, c).to(q_latent.dtype)
