"""The DeepSeek-V3 transformer and its multi-token-prediction (MTP) layers.

Module names equal the Hugging Face checkpoint names (`model.layers.N.self_attn.q_a_proj.weight`,
`lm_head.weight`, ...), except MTP layers, stored as `model.layers.{num_hidden_layers + k}` in the
checkpoint and held here as `mtp.{k}`; `checkpoint_name` maps between the two. Layers sit in a dict
keyed by their index, so a pipeline stage holds just its own layers under the same names.
"""

from __future__ import annotations

import torch
from torch import nn

from moelaunch.model.attention import MLA, AttnImpl
from moelaunch.model.batch import BatchLayout
from moelaunch.model.config import ModelArgs
from moelaunch.model.kv_cache import PagedLatentCache, SparseAttention
from moelaunch.model.linear import Linear
from moelaunch.model.mlp import MLP
from moelaunch.model.moe import MoE
from moelaunch.model.norm import RMSNorm
from moelaunch.model.rope import RotaryEmbedding
from moelaunch.model.sharding import WHOLE, ModelShard


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)); the ffn is dense or MoE by index."""

    def __init__(self, args: ModelArgs, layer_id: int, shard: ModelShard = WHOLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = MLA(args, shard)
        self.mlp = (
            MoE(args, shard.expert_dispatch(args.n_routed_experts, layer_id), shard)
            if args.is_moe_layer(layer_id)
            else MLP(args.hidden_size, args.intermediate_size, shard)
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        layout: BatchLayout,
        impl: AttnImpl,
    ) -> torch.Tensor:
        if x.shape[0]:  # a rank with no tokens skips attention but still joins the MoE exchange
            attended = self.self_attn(self.input_layernorm(x), rope, cos_sin, layout, self.layer_id, impl)
            x, h = self.post_attention_layernorm.add(x, attended)
        else:
            h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            # A static step routes MoE rows on the device (no counts read back); the MoE adds the
            # residual in its combine where it can.
            valid = layout.valid_rows if layout.static else None
            return self.mlp(h, static=layout.static, valid=valid, residual=x)
        return x + self.mlp(h)


class SharedHead(nn.Module):
    """The MTP layer's own final norm; its projection is the main model's lm_head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """Predicts token i+2 from the main model's hidden state at i and the embedding of token i+1."""

    def __init__(self, args: ModelArgs, layer_id: int, shard: ModelShard = WHOLE) -> None:
        super().__init__(args, layer_id, shard)
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = Linear(2 * args.hidden_size, args.hidden_size)
        self.shared_head = SharedHead(args)


class DecoderStack(nn.Module):
    """`model.*` in the checkpoint: embedding (first stage), decoder layers, final norm (last stage)."""

    def __init__(self, args: ModelArgs, shard: ModelShard = WHOLE) -> None:
        super().__init__()
        if shard.first_stage:
            self.embed_tokens = shard.embedding(args.vocab_size, args.hidden_size)
        held = [i for i in range(args.num_hidden_layers) if shard.holds_layer(i)]
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, i, shard) for i in held})
        if shard.last_stage:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    """The whole model, or with a `shard` one rank's part of it (see model/sharding.py)."""

    def __init__(self, args: ModelArgs, with_mtp: bool = True, shard: ModelShard = WHOLE) -> None:
        super().__init__()
        self.args = args
        self.heads_max = shard.heads_max  # top-k block selection agrees over the TP ranks' heads
        self.model = DecoderStack(args, shard)
        if shard.last_stage:
            self.lm_head = shard.head(args.hidden_size, args.vocab_size)
        n_mtp = args.num_nextn_predict_layers if with_mtp and shard.last_stage else 0
        self.mtp = nn.ModuleList(MTPLayer(args, args.num_hidden_layers + k, shard) for k in range(n_mtp))
        self.rope = RotaryEmbedding(args)
        self.attn_impl: AttnImpl = "auto"
        self.checkpoint_bytes_read = 0  # set by the loader: how much of the checkpoint this rank read
        self.nonfinite_tensors: list[str] = []  # set by the loader: this rank's tensors holding NaN/inf

    # -- pieces on flat batches ([N] tokens laid out by a BatchLayout); pipeline stages call them --
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        dtype = self.compute_dtype()  # bf16 rows of a CPU model that computes in fp32
        return x if x.dtype == dtype else x.to(dtype)

    def run_layers(self, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """Every decoder layer this module holds, in order, over x [N, dim]."""
        cos_sin = self.rope.cos_sin(layout.positions)
        for layer in self.model.layers.values():
            x = layer(x, self.rope, cos_sin, layout, self.attn_impl)
        return x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits from final-normed hidden states."""
        return self.lm_head(hidden).float()

    def mtp_forward(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        layout: BatchLayout,
        rows: torch.Tensor | None = None,
        depth: int = 0,
    ):
        """MTP logits [N, vocab] for token i+2 from hidden [N, dim] (position i) and next_ids [N] (i+1);
        with `rows`, only those rows' logits (every row still fills the MTP layer's cache)."""
        layer = self.mtp[depth]
        e = layer.enorm(self.embed(next_ids))
        x = layer.eh_proj(torch.cat([e, layer.hnorm(hidden)], dim=-1))
        x = layer(x, self.rope, self.rope.cos_sin(layout.positions), layout, self.attn_impl)
        return self.head(layer.shared_head.norm(x if rows is None else x[rows]))

    # -- the rectangular API: input_ids [B, T], all sequences at the same positions --
    def layer_ids(self) -> list[int]:
        """Global indices of the decoder (and MTP) layers this module holds."""
        return [int(i) for i in self.model.layers] + [layer.layer_id for layer in self.mtp]

    def stack_experts(self) -> None:
        """For fast small-batch inference: every MoE layer's routed experts stacked (MoE.stack_experts),
        every other MLP's gate and up projections as one (MLP.stack_gate_up), and each attention's
        q_a and kv_a projections as one (MLA.fuse_input_projections)."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.stack_experts()
            elif isinstance(module, MLA):
                module.fuse_input_projections()
        routed = {id(mlp) for m in self.modules() if isinstance(m, MoE) for mlp in m.experts.values()}
        for module in self.modules():
            if isinstance(module, MLP) and id(module) not in routed:
                module.stack_gate_up()

    def compute_dtype(self) -> torch.dtype:
        # Norm weights are never quantized: their dtype is the compute dtype.
        return next(iter(self.model.layers.values())).input_layernorm.weight.dtype

    def weight_dtype(self) -> torch.dtype:
        """The dtype float projections are held in (bf16 on a CPU that computes in fp32 from them), which
        the KV cache takes too; the compute dtype when they are quantized."""
        weight = next(iter(self.model.layers.values())).self_attn.kv_a_proj_with_mqa.weight
        plain = weight.is_floating_point() and weight.element_size() >= 2
        return weight.dtype if plain else self.compute_dtype()

    def new_paged_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        fp8: bool = False,
        sparse: SparseAttention | None = None,
    ) -> PagedLatentCache:
        """A paged cache for this module's layers; fp8 stores e4m3 values with per-token scales, sparse
        limits what queries attend to (see `PagedLatentCache`)."""
        device = next(iter(self.model.layers.values())).input_layernorm.weight.device
        dtype = dtype or self.weight_dtype()
        return PagedLatentCache(
            self.args, num_blocks, block_size, self.layer_ids(), dtype, device, fp8, sparse, self.heads_max
        )

    def new_cache(self, batch: int, max_len: int) -> PagedLatentCache:
        """A contiguous cache for `batch` sequences of up to max_len tokens (one block each)."""
        return self.new_paged_cache(batch, max_len)

    def hidden_states(
        self, input_ids: torch.Tensor, start_pos: int = 0, cache: PagedLatentCache | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, dim] for tokens at positions start_pos..start_pos+T-1."""
        b, t = input_ids.shape
        layout = BatchLayout.rectangle(b, t, start_pos, cache, input_ids.device)
        x = self.run_layers(self.embed(input_ids.flatten()), layout)
        return self.final_norm(x).view(b, t, -1)

    def forward(
        self, input_ids: torch.Tensor, start_pos: int = 0, cache: PagedLatentCache | None = None
    ) -> torch.Tensor:
        """Logits [B, T, vocab]; with a cache, earlier positions come from it and new ones are stored."""
        return self.head(self.hidden_states(input_ids, start_pos, cache))

    def mtp_logits(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        start_pos: int = 0,
        cache: PagedLatentCache | None = None,
        depth: int = 0,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] for token i+2 from `hidden` (main model, position i) and `next_ids` (i+1)."""
        b, t = next_ids.shape
        layout = BatchLayout.rectangle(b, t, start_pos, cache, next_ids.device)
        logits = self.mtp_forward(hidden.reshape(b * t, -1), next_ids.flatten(), layout, depth=depth)
        return logits.view(b, t, -1)


def checkpoint_name(param: str, args: ModelArgs) -> str:
    """The checkpoint tensor name of a parameter or buffer of `Transformer`."""
    if param.startswith("mtp."):
        k, rest = param[len("mtp.") :].split(".", 1)
        return f"model.layers.{args.num_hidden_layers + int(k)}.{rest}"
    return param
