"""A rank's weights as the plan counts them: the tensors its shard holds (parallel.shard_tensors), their
bytes under the deployment's dtype and quantization, and the tensors grouped into parts a reader can
multiply out by hand: `count` copies (layers, or layers x experts) of one copy's tensors."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from moelaunch.model.quantization import IntQuant, is_fp8_in_deepseek_checkpoints, is_quantizable
from moelaunch.parallel.shard_tensors import ShardTensor

# Parts in print order: name, pattern over a tensor name with its layer and expert ids as `*`, and how
# the copies are counted ({layers}: layers held, {experts}: experts held per layer).
PARTS = (
    ("embedding", r"model\.embed_tokens\..+", "first stage"),
    ("attention + norms", r"model\.layers\.\*\.(self_attn|\w+_layernorm)\..+", "{layers} layers"),
    ("dense MLP", r"model\.layers\.\*\.mlp\.(gate|up|down)_proj\..+", "{layers} dense layers"),
    ("router + shared experts", r"model\.layers\.\*\.mlp\.(gate|shared_experts)\..+", "{layers} MoE layers"),
    ("routed experts", r"model\.layers\.\*\.mlp\.experts\.\*\..+", "{layers} MoE layers x {experts} experts"),
    ("final norm + lm_head", r"(model\.norm|lm_head)\..+", "last stage"),
)
_ID = re.compile(r"\.(\d+)\.")
_LAYER_PREFIX = "model.layers.*."


def is_fp8(t: ShardTensor, dtype: str) -> bool:
    """Under fp8 the projections are block-FP8; embedding, lm_head, norms and gate stay 16-bit."""
    return dtype == "fp8" and is_fp8_in_deepseek_checkpoints(t.name, t.shape)


def param_bytes(t: ShardTensor, dtype: str) -> int:
    # The router bias is fp32 whatever the model dtype (the loader keeps routing decisions in fp32).
    if dtype == "float32" or t.name.endswith("e_score_correction_bias"):
        return 4
    return 1 if is_fp8(t, dtype) else 2


def scale_blocks(t: ShardTensor, block: tuple[int, int]) -> tuple[int, int]:
    rows, cols = t.shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def int4_groups(t: ShardTensor, quant: IntQuant) -> int:
    """Groups per row of an int4 projection as a rank holds it: a slice of the input dim keeps local
    groups of gcd(group, slice) columns (`model.quantization.int4_local_group`)."""
    cols = t.shape[1]
    group = math.gcd(quant.group_size, cols) if t.split_dim == 1 and t.tp > 1 else quant.group_size
    return math.ceil(cols / group)


def int_quant_bytes(t: ShardTensor, quant: IntQuant) -> int:
    """A projection under int8 / w8a8: 1 B per value + one fp32 scale per output row; int4: 1 B per two
    values + per row and group one fp32 scale and a 1-byte zero point (model/linear.py's layouts)."""
    rows, cols = t.shape
    if quant.method == "int4":
        return rows * (cols // 2) + rows * int4_groups(t, quant) * (4 + 1)
    return rows * cols + rows * 4


def tensor_bytes(t: ShardTensor, dtype: str, block: tuple[int, int], quant: IntQuant | None = None) -> int:
    """Its values plus, under fp8, one fp32 scale per block; a projection under `quant`: int_quant_bytes."""
    if quant is not None and is_quantizable(t.name, t.shape):
        return int_quant_bytes(t, quant)
    size = math.prod(t.shape) * param_bytes(t, dtype)
    if is_fp8(t, dtype):
        size += math.prod(scale_blocks(t, block)) * 4
    return size


@dataclass(frozen=True)
class WeightPart:
    """`count` copies of the same tensors (one per layer, or per layer and expert) held by a rank."""

    name: str
    count: int
    count_note: str
    tensors: tuple[ShardTensor, ...]  # one copy's, named without their layer prefix

    def unit_bytes(self, dtype: str, block: tuple[int, int], quant: IntQuant | None = None) -> int:
        return sum(tensor_bytes(t, dtype, block, quant) for t in self.tensors)

    def nbytes(self, dtype: str, block: tuple[int, int], quant: IntQuant | None = None) -> int:
        return self.count * self.unit_bytes(dtype, block, quant)


def weight_parts(tensors: Iterable[ShardTensor]) -> tuple[WeightPart, ...]:
    """Group a rank's tensors into PARTS, each as copies of one copy's tensors (every copy must hold the
    same, or count x one copy would not be the rank's weight)."""
    copies: dict[str, dict[tuple[int, ...], list[ShardTensor]]] = {name: {} for name, _, _ in PARTS}
    for t in tensors:
        starred = _ID.sub(".*.", t.name)
        part = next((name for name, pattern, _ in PARTS if re.fullmatch(pattern, starred)), None)
        if part is None:
            raise ValueError(f"{t.name}: no weight part of the plan holds this tensor")
        ids = tuple(int(i) for i in _ID.findall(t.name))
        copies[part].setdefault(ids, []).append(replace(t, name=starred.removeprefix(_LAYER_PREFIX)))
    parts = []
    for name, _, note in PARTS:
        held = copies[name]
        if not held:
            continue
        first, *others = held.values()
        if any(other != first for other in others):
            raise ValueError(f"weight part {name!r}: its copies do not all hold the same tensors")
        layers = len({ids[:1] for ids in held})
        count_note = note.format(layers=layers, experts=len(held) // layers)
        parts.append(WeightPart(name, len(held), count_note, tuple(first)))
    return tuple(parts)
