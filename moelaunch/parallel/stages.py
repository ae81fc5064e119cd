"""Pipeline stages: contiguous layer ranges whose weight is balanced, MoE layers counting for
their (much larger) expert weights, the embedding on the first stage and the head on the last."""

from __future__ import annotations

import torch

from moelaunch.model.config import ModelArgs
from moelaunch.model.transformer import DecoderLayer
from moelaunch.parallel.mesh import LayoutError


def layer_params(args: ModelArgs) -> list[int]:
    """Parameters of each decoder layer, counted on the module itself: what a stage must hold and, when
    decoding, stream per step. One layer of each kind (dense, MoE) is built, on the meta device."""
    per_kind: dict[bool, int] = {}
    counts = []
    for i in range(args.num_hidden_layers):
        moe = args.is_moe_layer(i)
        if moe not in per_kind:
            with torch.device("meta"):
                per_kind[moe] = sum(p.numel() for p in DecoderLayer(args, i).parameters())
        counts.append(per_kind[moe])
    return counts


def assign_stages(args: ModelArgs, pp: int) -> list[list[int]]:
    """Split layers 0..L-1 into `pp` contiguous non-empty ranges minimizing the heaviest stage."""
    n = args.num_hidden_layers
    if pp > n:
        raise LayoutError(f"pp={pp} exceeds num_hidden_layers={n}: every stage needs a layer")
    embed = args.vocab_size * args.hidden_size
    cost = layer_params(args)
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
