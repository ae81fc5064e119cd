"""Multi-head latent attention (MLA), in the naive and the weight-absorbed form.

Both forms read the same latent cache (c_kv after its norm, and rotated k_pe). The naive form
expands the latent into per-head keys and values; the absorbed form folds kv_b_proj into the query
and the output instead, so decode never materializes per-head keys.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moelaunch import kernels
from moelaunch.model import prefill_attention
from moelaunch.model.batch import BatchLayout, DecodeRows
from moelaunch.model.config import ModelArgs
from moelaunch.model.decode_heads import DecodeHeadWeights
from moelaunch.model.linear import Linear
from moelaunch.model.norm import RMSNorm
from moelaunch.model.rope import RotaryEmbedding
from moelaunch.model.sharding import WHOLE, ModelShard

AttnImpl = Literal["auto", "naive", "absorbed"]


def causal_mask(n_queries: int, n_keys: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[T, S] additive mask for queries at positions S-T..S-1 over keys 0..S-1; with a window, a query
    at q also drops the keys before q - window."""
    q_pos = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]
    k_pos = torch.arange(n_keys, device=device)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos < q_pos - window
    return torch.zeros(n_queries, n_keys, device=device).masked_fill_(hidden, float("-inf"))


def _is_rectangle(layout: BatchLayout) -> bool:
    """Every sequence starts at position 0 with the same length, back to back."""
    spans = layout.spans
    return bool(spans) and all(
        s.start_pos == 0 and s.length == spans[0].length and s.offset == i * s.length
        for i, s in enumerate(spans)
    )


class MLA(nn.Module):
    """Under tensor parallelism each rank holds its share of the heads: the per-head projections are
    split by column (q_b_proj / q_proj, kv_b_proj) and o_proj by row. The latent path is per token and
    the same for every head, so it is never split."""

    def __init__(self, args: ModelArgs, shard: ModelShard = WHOLE) -> None:
        super().__init__()
        heads = args.num_attention_heads
        self.n_heads = heads // shard.tp_size
        self.nope_dim = args.qk_nope_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.kv_rank = args.kv_lora_rank
        self.scale = args.softmax_scale
        q_out = heads * args.qk_head_dim
        if args.q_lora_rank:
            self.q_a_proj = Linear(args.hidden_size, args.q_lora_rank)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = shard.column(args.q_lora_rank, q_out)
        else:
            self.q_proj = shard.column(args.hidden_size, q_out)
        self.kv_a_proj_with_mqa = Linear(args.hidden_size, args.kv_lora_rank + args.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        self.kv_b_proj = shard.column(args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim))
        self.o_proj = shard.row(heads * args.v_head_dim, args.hidden_size)
        self._decode_heads = DecodeHeadWeights()
        self._decode_einsum = DecodeHeadWeights(per_head_stacks=False)
        # Set by fuse_input_projections: q_a_proj and kv_a_proj_with_mqa as one product. In a tuple, so
        # it is no submodule: the checkpoint's names stay the model's only parameters.
        self._joint_a: tuple[Linear] | None = None

    def fuse_input_projections(self) -> None:
        """q_a_proj and kv_a_proj_with_mqa read the same input: with plain weights, one product (one
        kernel instead of two). Their weights become views of the joint one, so no memory is added."""
        q, kv = getattr(self, "q_a_proj", None), self.kv_a_proj_with_mqa
        if q is None or not (q.is_plain() and kv.is_plain()) or q.weight.dtype != kv.weight.dtype:
            return
        joint = torch.cat([q.weight.data, kv.weight.data])
        with torch.device("meta"):
            linear = Linear(q.in_features, joint.shape[0])
        linear.weight = nn.Parameter(joint, requires_grad=False)
        q.weight.data, kv.weight.data = joint[: q.out_features], joint[q.out_features :]
        self._joint_a = (linear,)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        layout: BatchLayout,
        layer: int,
        impl: AttnImpl = "auto",
    ) -> torch.Tensor:
        """x [N, dim] -> [N, dim]. With a cache, new latents are stored first; single-token spans
        (decodes) then attend together through the paged decode kernel, longer spans one by one."""
        n = x.shape[0]
        cos, sin = cos_sin
        if self._joint_a is not None:
            q_a, kv_a = self._joint_a[0](x).split(
                [self.q_a_proj.out_features, self.kv_rank + self.rope_dim], -1
            )
            q_norm, kv_norm = self.q_a_layernorm, self.kv_a_layernorm
            q_a, latent = kernels.mla_input_norms(
                q_a, q_norm.weight, q_norm.eps, kv_a, kv_norm.weight, kv_norm.eps, cos, sin, rope.interleaved
            )
            q = self.q_b_proj(q_a)
        else:
            kv_a = self.kv_a_proj_with_mqa(x)
            q = (
                self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
                if hasattr(self, "q_b_proj")
                else self.q_proj(x)
            )
        # [T, H, nope | rope] with the rope part rotated: one tensor serves both forms (the naive one
        # dots it with [k_nope | k_pe] as is).
        q = kernels.rotate_tail(q.view(n, self.n_heads, -1), cos, sin, self.rope_dim, rope.interleaved)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        # The cached latent [c_kv | k_pe]: normalized and rotated (with q_a's norm above when joint), then
        # stored as is.
        if self._joint_a is None:
            norm = self.kv_a_layernorm
            latent = kernels.mla_latent(kv_a, norm.weight, norm.eps, cos, sin, rope.interleaved)
        kv, k_pe = latent.split([self.kv_rank, self.rope_dim], dim=-1)
        cache = layout.cache
        if cache is not None:
            cache.store(layer, layout.slots, latent)
        if cache is None and impl != "absorbed" and _is_rectangle(layout):
            out = self._naive_rectangle(q, kv, k_pe, len(layout.spans))
            return self.o_proj(out.flatten(1))
        decodes = layout.decode_rows if impl != "naive" else None
        if decodes is not None and decodes.every_row:
            return self.o_proj(self._decode_batch(q_nope, q_pe, layout, decodes, layer).flatten(1))
        out = x.new_empty(n, self.n_heads, self.v_dim)
        if decodes is not None:
            out[decodes.rows] = self._decode_batch(
                q_nope[decodes.rows], q_pe[decodes.rows], layout, decodes, layer
            )
        skip = set(decodes.spans) if decodes is not None else set()
        prompts = sum(span.length > 1 for i, span in enumerate(layout.spans) if i not in skip)
        # Several prompt chunks: every row's own keys and values from one kv_b GEMM, not one per chunk.
        own = self._own_keys_values(kv, k_pe, layout, layer) if prompts > 1 and impl != "absorbed" else None
        for i, span in enumerate(layout.spans):
            if i in skip:
                continue
            rows = slice(span.offset, span.offset + span.length)
            if span.length > 1 and impl != "absorbed":
                own_rows = None if own is None else (own[0][rows], own[1][rows])
                out[rows] = self._prefill(q[rows], kv[rows], k_pe[rows], layout, i, layer, own_rows)
                continue
            keys, pes = kv[rows], k_pe[rows]
            # A span that starts the sequence has all its keys in this pass; earlier ones come from the
            # cache (read back only when it holds them in another dtype, as decode will see them), from
            # the first one a sliding window lets its first query see.
            if cache is not None and (span.start_pos > 0 or cache.pool.dtype != kv.dtype):
                first = cache.sparse.first_visible(span.start_pos)
                keys, pes = cache.gather(layer, layout.block_tables[i], span.end_pos, first)
                # A bf16 cache under fp32 compute (the CPU's bf16): its rounded values, in fp32.
                keys, pes = keys.to(kv.dtype), pes.to(kv.dtype)
            window = cache.sparse.window if cache is not None else None
            mask = causal_mask(span.length, keys.shape[0], x.device, window) if span.length > 1 else None
            if impl != "naive":
                out[rows] = self._absorbed(q_nope[rows], q_pe[rows], keys, pes, mask)
            else:
                out[rows] = self._naive(q[rows], keys, pes)
        return self.o_proj(out.flatten(1))

    def _naive_rectangle(self, q, kv, k_pe, batch: int) -> torch.Tensor:
        """Equal-length sequences without a cache (training, the [B, T] API): one fused causal
        attention over the whole batch instead of a loop over sequences."""
        t = q.shape[0] // batch
        k, v = self._keys_values(kv.reshape(batch, t, -1), k_pe.reshape(batch, t, -1))
        q = q.reshape(batch, t, self.n_heads, -1)
        if q.device.type == "cpu":
            # The CPU's fused (flash) kernel takes one head size for q, k and v; with narrower values SDPA
            # falls back to unfused math over a [T, T] score matrix, 20x slower at 12K tokens.
            v = F.pad(v, (0, max(0, q.shape[-1] - self.v_dim)))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale
        )
        return out[..., : self.v_dim].transpose(1, 2).reshape(batch * t, self.n_heads, self.v_dim)

    def _keys_values(self, kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [..., S, H, nope + rope] and values [..., S, H, v] expanded from the latent."""
        kv = self.kv_b_proj(kv).unflatten(-1, (self.n_heads, self.nope_dim + self.v_dim))
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def _decode_batch(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, layout: BatchLayout, decodes: DecodeRows, layer: int
    ) -> torch.Tensor:
        """The decode rows' queries ([R, H, *]) at once, in the absorbed form over the paged latent
        cache: [R, H, v]."""
        # The kernel reads float weights in their own dtype (bf16 under fp32 rows): no copy per step.
        held = self.kv_b_proj.weight
        w_uk, w_uv = self._absorbed_weights(
            held.dtype if self.kv_b_proj.is_plain() else self._dense_dtype(q_nope)
        )
        heads_kernel = kernels.uses_grouped_linear_kernel(q_nope, q_nope.shape[0], w_uk)
        if heads_kernel:
            uk_t, uv = self._decode_heads.get(w_uk, w_uv, held, w_uk.dtype)
            q_latent = kernels.per_head_linear(q_nope, uk_t)
        else:
            if w_uk.dtype != q_nope.dtype:
                # fp32 rows meet bf16 weights as bf16 where the CPU has bf16 units (oneDNN's bf16 GEMM;
                # the bf16 queries go on into the kernel as they are), elsewhere fp32 weights: either
                # way contiguous stacks made once, not converted or gathered on every step.
                dtype = w_uk.dtype if kernels.bf16_gemm_units(q_nope) else q_nope.dtype
                w_uk, w_uv = self._decode_einsum.get(w_uk, w_uv, held, dtype)
            q_latent = torch.einsum("rhd,hdc->rhc", q_nope.to(w_uk.dtype), w_uk)
        out_latent = layout.cache.decode(
            layer, q_latent, q_pe, decodes.block_tables, decodes.seq_lens, self.scale, decodes.rows_per_table
        )
        if heads_kernel:
            return kernels.per_head_linear(out_latent, uv)
        return torch.einsum("rhc,hdc->rhd", out_latent.to(w_uv.dtype), w_uv).to(q_nope.dtype)

    def _dense_dtype(self, rows: torch.Tensor) -> torch.dtype:
        """The dtype an integer or block-FP8 kv_b is dequantized to for the absorbed form: kv_a_proj's,
        which integer quantization leaves in the model's float dtype (a bf16 model's fp32 rows on the
        CPU then read bf16 stacks, half the bytes of fp32 ones); the rows' where kv_a is 1-byte too."""
        kv_a = self.kv_a_proj_with_mqa.weight.dtype
        return kv_a if kv_a.is_floating_point and kv_a.itemsize >= 2 else rows.dtype

    def _absorbed_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into W_UK [H, nope, C] and W_UV [H, v, C]."""
        w = self.kv_b_proj.dense_weight(dtype).view(self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _naive(self, q, kv, k_pe) -> torch.Tensor:
        """Queries [T, H, nope | rope] over all S given keys (decode rows under impl="naive"), in fused
        attention with per-head keys and values expanded from the latent."""
        k, v = self._keys_values(kv, k_pe)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=self.scale
        )
        return out.transpose(0, 1)

    def _own_keys_values(
        self, kv, k_pe, layout: BatchLayout, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys and values of every row from its own latents as the cache holds them (a bf16
        cache under fp32 rows: rounded alike; an fp8 cache: read back from the rows' slots, as decode
        will see them)."""
        cache = layout.cache
        if cache is not None and cache.pool.dtype != kv.dtype:
            if cache.scales is not None:
                kv, k_pe = cache.read_slots(layer, layout.slots)
            else:
                kv, k_pe = kv.to(cache.dtype), k_pe.to(cache.dtype)
        return self._keys_values(kv, k_pe)

    def _prefill(self, q, kv, k_pe, layout: BatchLayout, index: int, layer: int, own=None) -> torch.Tensor:
        """A prompt chunk ([T, H, *] queries; kv, k_pe its own new latents, or `own`: the keys and values
        made from them) over its own keys, causally, and over the earlier keys of its sequence read from
        the cache one segment at a time, in the naive form (per-head keys cost nope + rope per score, the
        absorbed ones kv_rank + rope). Flash style: no [T, S] matrix, memory linear in the length (see
        prefill_attention)."""
        span, cache = layout.spans[index], layout.cache
        start, end = span.start_pos, span.end_pos
        window = cache.sparse.window if cache is not None else None
        if own is None:
            if cache is not None and cache.pool.dtype != kv.dtype:
                # Attend to the chunk's keys as the cache holds them (fp8), as decode will see them.
                kv, k_pe = cache.gather(layer, layout.block_tables[index], end, start)
            own = self._keys_values(kv, k_pe)
        q = q.transpose(0, 1)
        parts = [self._attend(q, *own, start, start, window, causal=True)]
        first = cache.sparse.first_visible(start) if cache is not None else start
        for seg_start in range(first, start, prefill_attention.KEY_SEGMENT):
            seg_end = min(start, seg_start + prefill_attention.KEY_SEGMENT)
            keys, pes = cache.gather(layer, layout.block_tables[index], seg_end, seg_start)
            parts.append(
                self._attend(q, *self._keys_values(keys, pes), start, seg_start, window, causal=False)
            )
        return prefill_attention.merge(parts).transpose(0, 1)

    def _attend(self, q, k, v, q_start: int, k_start: int, window: int | None, causal: bool):
        """(out, lse) of queries [H, T, *] at q_start.. over per-head keys k [S, H, *] and values v at
        k_start.."""
        mask = None
        if window is not None:
            mask = prefill_attention.band_mask(q_start, q.shape[1], k_start, k.shape[0], window, q.device)
        kv_b = self.kv_b_proj
        # A bf16 model attends in bf16 (its keys and values come from kv_b's bf16 GEMM).
        cpu_dtype = kv_b.weight.dtype if kv_b.is_plain() and kv_b.weight.dtype != torch.float32 else None
        return prefill_attention.attend(
            q,
            k.transpose(0, 1),
            v.transpose(0, 1),
            self.scale,
            causal=causal and mask is None,
            mask=mask,
            cpu_dtype=cpu_dtype,
        )

    def _absorbed(self, q_nope, q_pe, kv, k_pe, mask) -> torch.Tensor:
        """Attention in the latent space: W_UK folded into the query, W_UV applied after."""
        w_uk, w_uv = self._absorbed_weights(kv.dtype)
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_uk)
        scores = torch.einsum("thc,sc->hts", q_latent, kv) + torch.einsum("thr,sr->hts", q_pe, k_pe)
        probs = self._softmax(scores, mask).to(kv.dtype)
        out_latent = torch.einsum("hts,sc->thc", probs, kv)
        return torch.einsum("thc,hdc->thd", out_latent, w_uv)

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        scores = scores.float() * self.scale
        if mask is not None:
            scores = scores + mask
        return scores.softmax(dim=-1)
