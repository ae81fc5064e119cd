"""The methods `launch report` measures. Each is what it changes: options of the engine (`LLM(...)`, the
same keys as a deployment file's), or a checkpoint a `launch` tool derives from the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moelaunch.model.config import ModelArgs


def _half_the_experts(args: ModelArgs) -> list[str]:
    # Half the experts in half the groups: the router scores a group by its best two experts, so every
    # group keeps as many experts as before.
    groups = max(1, args.n_group // 2)
    keep = args.n_routed_experts // args.n_group * groups
    topk_groups = max(1, args.topk_group // 2)
    return ["prune", "--experts", str(keep), "--n-group", str(groups), "--topk-group", str(topk_groups)]


@dataclass(frozen=True)
class Method:
    name: str
    what: str
    options: dict[str, Any] = field(default_factory=dict)
    # The `launch` command (without SRC and DST, appended) that writes the method's checkpoint.
    derive: Callable[[ModelArgs], list[str]] | None = None
    approximation: bool = False  # changes what attention computes, beyond rounding


_ALL = [
    Method("baseline", "the checkpoint as `launch` runs it by default"),
    Method("mtp", "MTP speculative decoding (the checkpoint's MTP layer drafts)", {"speculative": "mtp"}),
    Method("int8", "INT8 weight-only, per output channel", {"quantization": "int8"}),
    Method("w8a8", "INT8 weights and per-token INT8 activations", {"quantization": "w8a8"}),
    Method("int4", "INT4 weight-only, groups of 128 with zero points", {"quantization": "int4"}),
    Method("kv-fp8", "FP8 (e4m3) latent KV cache with per-token scales", {"kv_cache_dtype": "fp8"}),
    Method(
        "window-64",
        "sliding-window attention over the last 64 tokens",
        {"attention": {"window": 64}},
        approximation=True,
    ),
    Method(
        "topk-4",
        "decode attends to its 4 best-scoring cache blocks",
        {"attention": {"topk_blocks": 4}},
        approximation=True,
    ),
    Method(
        "prune-experts",
        "half the routed experts (the least used on calibration prompts) removed",
        derive=_half_the_experts,
    ),  # fmt: skip
    Method(
        "sparse-2:4",
        "2:4 magnitude sparsity of every projection",
        derive=lambda _: ["prune", "--sparsity", "0.5", "--pattern", "2:4"],
    ),
    Method(
        "int8+kv-fp8", "INT8 weights and the FP8 KV cache", {"quantization": "int8", "kv_cache_dtype": "fp8"}
    ),
    Method(
        "int4+kv-fp8", "INT4 weights and the FP8 KV cache", {"quantization": "int4", "kv_cache_dtype": "fp8"}
    ),
]
METHODS: dict[str, Method] = {m.name: m for m in _ALL}
# A distilled student is trained (minutes to hours), not derived in a report run: `--student DIR` adds it.
DISTILLED = Method("distilled", "a student distilled from the model (`launch distill`)")
