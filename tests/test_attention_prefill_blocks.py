"""Causal prompt attention by query blocks (each over only its visible keys) against one masked
softmax over every key, for fresh prompts and for chunks that follow a cached prefix."""

from __future__ import annotations

import pytest
import torch
from error_bounds import assert_within, dot_logit_error, softmax_average_error

from moelaunch.measure.random_checkpoint import SHAPES
from moelaunch.model.attention import MLA, PREFILL_QUERY_BLOCK, causal_mask
from moelaunch.model.config import args_from_hf_config


@pytest.mark.parametrize(
    ("n_queries", "n_keys"),
    [
        (2, 2),
        (PREFILL_QUERY_BLOCK, PREFILL_QUERY_BLOCK),
        (2 * PREFILL_QUERY_BLOCK + 45, 2 * PREFILL_QUERY_BLOCK + 45),  # a partial last block
        (PREFILL_QUERY_BLOCK + 7, 3 * PREFILL_QUERY_BLOCK),  # a chunk after a cached prefix
    ],
)
def test_blocked_causal_attention_equals_one_masked_softmax(n_queries, n_keys):
    torch.manual_seed(n_queries + n_keys)
    args = args_from_hf_config(SHAPES["tiny"])
    mla = MLA(args).requires_grad_(False)
    torch.nn.init.normal_(mla.kv_b_proj.weight, std=0.3)
    heads, nope, rope = mla.n_heads, mla.nope_dim, mla.rope_dim
    q = torch.randn(n_queries, heads, nope + rope)
    kv, k_pe = torch.randn(n_keys, mla.kv_rank), torch.randn(n_keys, rope)
    mask = causal_mask(n_queries, n_keys, torch.device("cpu"))

    out = mla._naive(q, kv, k_pe, mask)

    k, v = mla._keys_values(kv, k_pe)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * mla.scale + mask.double()
    expected = torch.einsum("hts,shv->thv", scores.softmax(dim=-1), v.double())
    bound = torch.stack(
        [
            softmax_average_error(scores[h], dot_logit_error(q[:, h], k[:, h], mla.scale), v[:, h].double())
            for h in range(heads)
        ],
        dim=1,
    )
    assert_within(out, expected, bound)
