"""Pipeline stages: contiguous layer ranges whose weight is balanced, MoE layers counting for
their (much larger) expert weights, the embedding on the first stage and the head on the last."""

from __future__ import annotations

from moelaunch.model.config import ModelArgs
from moelaunch.parallel.mesh import LayoutError


def layer_cost(args: ModelArgs, layer_id: int) -> int:
    """Parameters of one decoder layer: what a stage must hold and, when decoding, stream per step."""
    d = args.hidden_size
    q = d * args.q_lora_rank + args.q_lora_rank * args.num_attention_heads * args.qk_head_dim
    if not args.q_lora_rank:
        q = d * args.num_attention_heads * args.qk_head_dim
    kv = d * (args.kv_lora_rank + args.qk_rope_head_dim)
    kv += args.kv_lora_rank * args.num_attention_heads * (args.qk_nope_head_dim + args.v_head_dim)
    attn = q + kv + args.num_attention_heads * args.v_head_dim * d
    if args.is_moe_layer(layer_id):
        experts = args.n_routed_experts + args.n_shared_experts
        return attn + 3 * d * args.moe_intermediate_size * experts + d * args.n_routed_experts
    return attn + 3 * d * args.intermediate_size


def assign_stages(args: ModelArgs, pp: int) -> list[list[int]]:
    """Split layers 0..L-1 into `pp` contiguous non-empty ranges minimizing the heaviest stage."""
    n = args.num_hidden_layers
    if pp > n:
        raise LayoutError(f"pp={pp} exceeds num_hidden_layers={n}: every stage needs a layer")
    embed = args.vocab_size * args.hidden_size
    cost = [layer_cost(args, i) for i in range(n)]
    cost[0] += embed
    cost[-1] += embed  # the LM head
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    # best[s][i]: minimal heaviest-stage cost splitting layers [0, i) into s stages; cut[s][i] its last cut.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for s in range(1, pp + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(pp, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [list(range(a, b)) for a, b in reversed(bounds)]
