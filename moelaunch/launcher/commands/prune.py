"""`launch prune MODEL OUT (--experts K | --heads H | --sparsity S [--pattern 2:4]) [--calibration FILE]`:
write a pruned copy of a checkpoint that loads unchanged (logic in launcher/compress)."""

from __future__ import annotations

import argparse

from moelaunch.launcher.commands import count, fraction
from moelaunch.tools.expert_pruning import prune_experts
from moelaunch.tools.head_pruning import prune_heads
from moelaunch.tools.magnitude_pruning import PATTERNS, prune_magnitude


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prune", help="prune routed experts, attention heads or small weights of a checkpoint")
    p.add_argument("model", help="source Hugging Face checkpoint directory")
    p.add_argument("out", help="destination directory (created; must be new or empty)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument(
        "--experts", type=count, metavar="K", help="keep the K most used routed experts per layer"
    )
    how.add_argument(
        "--heads", type=count, metavar="H", help="keep the H most important attention heads per layer"
    )
    how.add_argument(
        "--sparsity", type=fraction, metavar="S", help="zero the fraction S of smallest projection weights"
    )
    p.add_argument(
        "--pattern", choices=sorted(PATTERNS), help="with --sparsity 0.5: keep 2 of every 4 inputs"
    )
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="prompts for --experts/--heads: one a line, or JSON lines {prompt} / {messages} "
        "(default: 256 problems of the bundled task family)",
    )
    p.add_argument("--n-group", type=count, help="with --experts: a new n_group for the router")
    p.add_argument("--topk-group", type=count, help="with --experts: a new topk_group for the router")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Options that do not fit the chosen method are refused, not ignored.
    if args.pattern is not None and args.sparsity is None:
        raise ValueError("--pattern goes with --sparsity (e.g. --sparsity 0.5 --pattern 2:4)")
    if args.experts is None and (args.n_group is not None or args.topk_group is not None):
        raise ValueError("--n-group and --topk-group go with --experts")
    if args.sparsity is not None:
        if args.calibration is not None:
            raise ValueError("--sparsity prunes by weight magnitude and takes no --calibration")
        out = prune_magnitude(args.model, args.out, args.sparsity, args.pattern)
        shape = f" ({args.pattern})" if args.pattern else ""
        print(f"wrote {out}: projection weights {args.sparsity:.0%} zero{shape}")
    elif args.experts is not None:
        result = prune_experts(
            args.model, args.out, args.experts, args.calibration, args.n_group, args.topk_group
        )
        for layer, share in result.kept_share().items():
            print(f"layer {layer}: kept experts {result.kept[layer]} ({share:.1%} of calibration selections)")
        print(f"wrote {args.out}")
    else:
        kept = prune_heads(args.model, args.out, args.heads, args.calibration)
        for layer, heads in kept.items():
            print(f"layer {layer}: kept heads {heads}")
        print(f"wrote {args.out}")
    return 0
