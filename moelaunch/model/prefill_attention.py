"""Prompt attention in pieces, flash style: a chunk of queries attends to its own keys (causal) and to
the earlier keys segment by segment, and the partial results are merged by their log-sum-exp. No piece
is larger than chunk x KEY_SEGMENT, so memory stays linear in the sequence length, and only the chunk's
own square needs a causal mask (none is ever materialized on the CPU path).

Tensors are per head: queries [H, T, d], keys [H, S, d], values [H, S, dv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Earlier keys are expanded from the latent cache and attended this many at a time: large enough to keep
# the fused kernel efficient, small enough that the expanded keys and values stay a few MB per head.
KEY_SEGMENT = 8192
# Queries per block on the portable (non-CPU) path, which computes scores explicitly.
QUERY_BLOCK = 256


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    portable: bool = False,
    cpu_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with its log-sum-exp: (out [H, T, dv] in q's dtype, lse [H, T] in float32).

    causal: T == S and query i sees keys 0..i. mask: additive [T, S] (0 or -inf); a row it hides
    entirely gets lse = -inf, so it weighs nothing in `merge`. portable: the explicit path that runs on
    any device (the CPU one calls torch's fused CPU flash kernel, the only SDPA entry returning the lse).
    cpu_dtype: what the CPU kernel computes in (default q's): a bf16 model's prompts attend in bf16, as
    its GEMMs multiply, with fp32 sums (1.8x the fp32 kernel at 64 tokens a sequence).
    """
    if q.device.type == "cpu" and not portable:
        out, lse = _flash_cpu(q, k, v, scale, causal, mask, cpu_dtype or q.dtype)
        out = out.to(q.dtype)
    else:
        out, lse = _explicit(q, k, v, scale, causal, mask)
    if mask is not None:
        lse = lse.masked_fill(~torch.isfinite(mask).any(dim=-1), float("-inf"))
    return out, lse


def _flash_cpu(q, k, v, scale, causal, mask, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # The kernel wants 4-d inputs, one head size for q, k and v, and a mask of the query's dtype: MLA's
    # values are narrower than its keys, so they are zero-padded (extra output columns, sliced off).
    dv = v.shape[-1]
    width = max(q.shape[-1], dv)
    # One dtype for the three: the one asked for (keys from a bf16 cache under fp32 activations come as
    # stored, and are widened unless the model computes in bf16).
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
    if mask is not None:
        mask = mask.to(q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, attn_mask=mask, scale=scale
    )
    return out[0, ..., :dv], lse[0].float()


def _explicit(q, k, v, scale, causal, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores written out, QUERY_BLOCK queries at a time ([H, QUERY_BLOCK, S] at most)."""
    outs, lses = [], []
    n_keys = k.shape[1]
    for start in range(0, q.shape[1], QUERY_BLOCK):
        end = min(q.shape[1], start + QUERY_BLOCK)
        visible = end if causal else n_keys  # a causal block sees no key past its last query
        scores = torch.matmul(q[:, start:end], k[:, :visible].transpose(1, 2)).float() * scale
        if causal:
            rows = torch.arange(start, end, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(visible, device=q.device)[None, :] > rows, float("-inf"))
        if mask is not None:
            scores = scores + mask[start:end, :visible]
        lse = scores.logsumexp(dim=-1)
        probs = (scores - lse[..., None]).exp().nan_to_num(0.0)  # a fully hidden row: no weight
        outs.append(torch.matmul(probs.to(v.dtype), v[:, :visible]))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The attention over all the parts' keys together, from each part's (out, lse)."""
    out, lse = parts[0]
    out = out.float()
    for part_out, part_lse in parts[1:]:
        total = torch.logaddexp(lse, part_lse)
        # A row no part has seen yet (both -inf) keeps weight 0 instead of NaN.
        mine = (lse - total).exp().nan_to_num(0.0)
        theirs = (part_lse - total).exp().nan_to_num(0.0)
        out = out * mine[..., None] + part_out.float() * theirs[..., None]
        lse = total
    return out.to(parts[0][0].dtype)


def band_mask(
    q_start: int, n_queries: int, k_start: int, n_keys: int, window: int, device: torch.device
) -> torch.Tensor | None:
    """Additive [T, S] mask of a sliding window (query p sees keys p - window .. p) for queries at
    q_start.. over keys at k_start..; None when the window hides none of these keys (the plain causal or
    unmasked path then runs, exactly as without a window)."""
    if k_start >= q_start + n_queries - 1 - window:
        return None
    q_pos = torch.arange(q_start, q_start + n_queries, device=device)[:, None]
    k_pos = torch.arange(k_start, k_start + n_keys, device=device)[None, :]
    hidden = (k_pos > q_pos) | (k_pos < q_pos - window)
    return torch.zeros(n_queries, n_keys, device=device).masked_fill_(hidden, float("-inf"))
