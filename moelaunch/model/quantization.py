"""Integer weight quantization of the projections: the methods, the tensors one projection becomes, and
the `quantization_config` a converted checkpoint carries. The tensor layouts are in `model/linear.py`.

Methods (`quantization=`): "none" (the checkpoint as it is), "int8" (weight-only, per output channel,
symmetric), "w8a8" (int8 weights and activations quantized per token at run time), "int4" (weight-only,
groups of 128 input columns, asymmetric with zero points, two values per byte).

Only projections (`*_proj.weight`, 2-D: attention, dense MLP, experts, MTP eh_proj) are quantized; the
embedding, norms, router gate and lm_head keep their dtype. A block-FP8 checkpoint is dequantized to fp32
first and then quantized (its errors add up: better quantize the bf16 original when there is one).
Under tensor parallelism a rank holds the integers of one process: a row-parallel projection (its input
columns sliced) is quantized from whole rows, and an int4 slice [a, b) keeps the row's groups as local
groups of gcd(G, a, b - a) columns, each with its global group's scale and zero point
(`int4_column_slice`), whether quantized at load or read from a converted checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from moelaunch import kernels

Quantization = Literal["none", "int8", "w8a8", "int4"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# quant_method in config.json is "moelaunch-<method>".
QUANT_METHOD_PREFIX = "moelaunch-"


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """The projections DeepSeek stores as FP8: attention, MLP, expert and MTP eh_proj weights."""
    return len(shape) == 2 and name.endswith("_proj.weight")


def is_fp8_in_deepseek_checkpoints(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek's block-FP8 checkpoints store in FP8: the quantizable projections and the
    MLA latent projection kv_a_proj_with_mqa, which integer quantization leaves 16-bit: the latent every
    head reads. Quantized too (tried in stop 47), it bought no measurable decode speed, and on the bundled
    model INT4's greedy agreement with the float model fell from 0.645 to 0.520 and W8A8's from 0.887 to
    0.785 (`launch report`; docs/benchmarks.md)."""
    return is_quantizable(name, shape) or (len(shape) == 2 and name.endswith("kv_a_proj_with_mqa.weight"))


def check_quantization(value: Any) -> str:
    """`value` if it names a method, else one ValueError listing them."""
    if not isinstance(value, str) or value not in QUANTIZATIONS:
        raise ValueError(f"quantization={value!r} must be one of {', '.join(QUANTIZATIONS)}")
    return value


@dataclass(frozen=True)
class IntQuant:
    """How projections are stored and run: method int8 | w8a8 | int4, and int4's group size (a model's
    is the checkpoint's; a Linear's is its own, narrower for some tensor-parallel slices)."""

    method: str
    group_size: int = kernels.INT4_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATIONS[1:]:
            raise ValueError(
                f"quantization method {self.method!r} must be one of {', '.join(QUANTIZATIONS[1:])}"
            )
        if self.group_size < 16 or self.group_size % 16:
            raise ValueError(f"int4 group size {self.group_size} must be a positive multiple of 16")

    @property
    def quantize_activations(self) -> bool:
        return self.method == "w8a8"

    def config(self) -> dict[str, Any]:
        """The checkpoint's quantization_config."""
        entry: dict[str, Any] = {"quant_method": QUANT_METHOD_PREFIX + self.method}
        if self.method == "int4":
            entry |= {"bits": 4, "group_size": self.group_size, "symmetric": False}
        else:
            entry |= {"bits": 8, "symmetric": True}
        entry["activation_scheme"] = "dynamic-per-token" if self.quantize_activations else "none"
        return entry


def stored_quantization(config: dict[str, Any] | None) -> IntQuant | None:
    """The method a checkpoint's quantization_config names; None for plain and block-FP8 checkpoints."""
    method = str((config or {}).get("quant_method", ""))
    if not method.startswith(QUANT_METHOD_PREFIX):
        return None
    try:
        return IntQuant(
            method.removeprefix(QUANT_METHOD_PREFIX), int(config.get("group_size", kernels.INT4_GROUP_SIZE))
        )
    except ValueError as e:
        raise ValueError(f"config.json quantization_config {config}: {e}") from None


def resolve_quantization(requested: str, config: dict[str, Any] | None, where: str) -> IntQuant | None:
    """What a load runs: the checkpoint's own method for "none"; otherwise the requested one, applied at
    load to a plain or block-FP8 checkpoint. An int8 checkpoint runs as int8 or w8a8 (same tensors);
    requantizing an integer checkpoint to another width is refused (its precision is already gone)."""
    check_quantization(requested)
    stored = stored_quantization(config)
    if requested == "none":
        return stored
    if stored is None:
        return IntQuant(requested)
    if stored.method == requested or {stored.method, requested} <= {"int8", "w8a8"}:
        return IntQuant(requested, stored.group_size)
    raise ValueError(
        f"{where} is already quantized ({stored.method}); load it with quantization='none' (or "
        f"'{stored.method}'), or quantize the unquantized checkpoint to {requested}"
    )


def quantize_weight(w: torch.Tensor, quant: IntQuant) -> dict[str, torch.Tensor]:
    """One projection weight [N, K] as its quantized tensors, keyed by name from `weight` on (the checkpoint
    name is the projection's prefix + key), computed in fp32."""
    if quant.method == "int4":
        packed, scale, zero = kernels.int4_weight_quant(w.float(), quant.group_size)
        return {"weight_packed": packed, "weight_scale": scale, "weight_zero_point": zero}
    q, scale = kernels.int8_weight_quant(w.float())
    return {"weight": q, "weight_scale": scale}


def int4_local_group(group_size: int, start: int, end: int, width: int) -> int:
    """The group size for input columns [start, end) of int4 rows `width` wide quantized in groups of
    `group_size`: the widest whose groups each lie inside one of the row's, and a multiple of 16 (the
    kernels' K tile); a ValueError naming tp and the widths where none is."""
    local = math.gcd(group_size, start, end - start)
    if local % 16:
        tp = width // (end - start)
        raise ValueError(
            f"int4 under tensor parallelism: a slice of {end - start} of {width} input columns (tp={tp}) at "
            f"column {start} cuts the groups of {group_size} into groups of {local}, and the int4 kernels "
            f"need multiples of 16: choose a tp for which {width}/tp is a multiple of 16"
        )
    return local


def int4_column_slice(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    quant: IntQuant,
    start: int,
    end: int,
    width: int,
) -> tuple[dict[str, torch.Tensor], IntQuant]:
    """Input columns [start, end) of int4 rows `width` wide, with the rows' own groups: `packed` holds the
    slice's bytes, `scale` and `zero` the rows' groups from the one holding `start` on. Each local group
    takes its global group's scale and zero point, so the slice dequantizes to the whole row's values.
    Returns the slice's tensors and its IntQuant (the local group size)."""
    group = quant.group_size
    local = int4_local_group(group, start, end, width)
    of_local = (torch.arange(start, end, local) // group) - start // group
    tensors = {
        "weight_packed": packed.contiguous(),
        "weight_scale": scale[:, of_local].contiguous(),
        "weight_zero_point": zero[:, of_local].contiguous(),
    }
    return tensors, dataclasses.replace(quant, group_size=local)
