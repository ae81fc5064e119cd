"""Build a Transformer from a Hugging Face checkpoint directory.

The model is built on the meta device, then every parameter is read from the checkpoint under its
HF name, shape-checked and placed: no random initialization, no second copy of the weights.
Block-FP8 weights are dequantized once at load, or kept as FP8 (W8A8 GEMM), as WeightSpec.dtype says.
Integer-quantized projections (`model/quantization.py`) are read as they are stored, or quantized at
load from a plain or block-FP8 checkpoint when `quantization=` asks for it.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moelaunch import kernels
from moelaunch.model.checkpoint import CheckpointError, CheckpointReader
from moelaunch.model.config import ModelArgs, load_args
from moelaunch.model.linear import Linear
from moelaunch.model.quantization import (
    IntQuant,
    int4_column_slice,
    is_quantizable,
    quantize_weight,
    resolve_quantization,
)
from moelaunch.model.rope import RotaryEmbedding
from moelaunch.model.shard_spec import ShardSpec, weight_shard
from moelaunch.model.sharding import WHOLE, ModelShard
from moelaunch.model.transformer import Transformer, checkpoint_name
from moelaunch.model.weight_spec import WeightSpec

log = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"
# Tensors some checkpoints carry that the model derives or shares instead of loading.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def has_mtp_weights(args: ModelArgs, reader: CheckpointReader) -> bool:
    return (
        args.num_nextn_predict_layers > 0
        and f"model.layers.{args.num_hidden_layers}.eh_proj.weight" in reader
    )


def _shared_mtp_copies(args: ModelArgs) -> set[str]:
    """The MTP layers' copies of the embedding and head: the model uses the main ones."""
    names = set()
    for k in range(args.num_nextn_predict_layers):
        prefix = f"model.layers.{args.num_hidden_layers + k}."
        names |= {prefix + "embed_tokens.weight", prefix + "shared_head.head.weight"}
    return names


def load_model(
    weights: WeightSpec | str | Path,
    device: str | torch.device = "cpu",
    with_mtp: bool = True,
    shard: ModelShard = WHOLE,
) -> Transformer:
    """Load a DeepSeek-V2/V3 HF checkpoint directory as a ready-to-run Transformer in eval mode.

    weights: the checkpoint and how to hold it (a path alone: its defaults, see WeightSpec).
    shard: for a parallel rank, its part of the model (the layers it holds, the slices it owns); then
    only those tensors and slices are read, and unread tensors are expected.
    """
    spec = weights if isinstance(weights, WeightSpec) else WeightSpec(str(weights))
    path, device = spec.model, torch.device(device)
    args = load_args(path)
    quant = resolve_quantization(spec.quantization, args.quantization, path)
    reader = CheckpointReader(path)
    mtp_in_checkpoint = has_mtp_weights(args, reader)
    with_mtp = with_mtp and mtp_in_checkpoint
    if args.num_nextn_predict_layers and not with_mtp:
        log.info("%s: no MTP weights loaded; speculative decoding with MTP is off", path)
    with torch.device("meta"):
        model = Transformer(args, with_mtp, shard)
    dtypes = _Dtypes(spec.compute_dtype(device), spec.weight_dtype(device))
    used = _fill_from_checkpoint(model, reader, dtypes, device, spec.keeps_fp8(device), quant)
    if shard.whole:
        _check_all_used(args, reader, used, skip_mtp=mtp_in_checkpoint and not with_mtp)
    broken = nonfinite_tensors(model)
    if broken:
        log.warning(
            "%s holds NaN or inf values in %d tensor(s) (%s%s): the model's outputs will be meaningless; "
            "check the download, or the conversion or training that wrote it",
            path, len(broken), ", ".join(broken[:4]), ", ..." if len(broken) > 4 else "",
        )  # fmt: skip
    model.rope = RotaryEmbedding(args).to(device)
    model.checkpoint_bytes_read = reader.bytes_read
    model.nonfinite_tensors = broken
    return model.eval().requires_grad_(False)


def nonfinite_tensors(model: nn.Module) -> list[str]:
    """Names of the model's float tensors holding a NaN or an inf (fp8 ones: a NaN code; e4m3 has no inf)."""
    return [
        name
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
        if holds_nonfinite(t)
    ]


def holds_nonfinite(t: torch.Tensor) -> bool:
    """Whether a float tensor holds a NaN or an inf (fp8 e4m3: a NaN code; it has no inf)."""
    if t.dtype == torch.float8_e4m3fn:
        return bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


@dataclass(frozen=True)
class _Dtypes:
    """weights: the projections' (Linear) and the embedding's weights; compute: the rest (norms, router)."""

    compute: torch.dtype
    weights: torch.dtype

    def of(self, module_name: str, module: nn.Module, attr: str) -> torch.dtype:
        held = isinstance(module, Linear) or module_name.endswith("embed_tokens")
        return self.weights if attr == "weight" and held else self.compute


def _fill_from_checkpoint(
    model: Transformer,
    reader: CheckpointReader,
    dtypes: _Dtypes,
    device: torch.device,
    keep_fp8: bool,
    quant: IntQuant | None,
) -> set[str]:
    args = model.args
    used: set[str] = set()
    for module_name, module in model.named_modules():
        for attr, current in list(module._parameters.items()) + list(module._buffers.items()):
            if current is None or module_name.startswith("rope"):
                continue
            param_name = f"{module_name}.{attr}" if module_name else attr
            name = checkpoint_name(param_name, args)
            if name == "lm_head.weight" and name not in reader and args.tie_word_embeddings:
                name = "model.embed_tokens.weight"
            spec = weight_shard(module, attr)
            dtype = dtypes.of(module_name, module, attr)
            if quant is not None and attr == "weight" and isinstance(module, Linear):
                loaded = _load_int_linear(module, reader, name, tuple(current.shape), spec, quant, device)
                if loaded is not None:
                    used |= loaded
                    continue
            _check_shape(reader, name, tuple(current.shape), spec)
            used.add(name)
            if reader.is_fp8(name):
                used.add(name + SCALE_SUFFIX)
                keep = keep_fp8 and isinstance(module, Linear)
                tensor, scale = _read_fp8(reader, name, spec, keep, dtype)
                if scale is not None:
                    module.weight_scale_inv = scale.to(device)
            else:
                tensor = _read(reader, name, spec)
                # routing decisions stay in fp32 whatever the model dtype
                tensor = tensor.float() if attr == "e_score_correction_bias" else tensor.to(dtype)
            tensor = tensor.to(device)
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                module._buffers[attr] = tensor
    return used


def _read(reader: CheckpointReader, name: str, spec: ShardSpec | None) -> torch.Tensor:
    if spec is None:
        return reader.read(name)
    return reader.read(name, dim=spec.dim, start=spec.start, end=spec.end)


def _read_fp8(
    reader: CheckpointReader, name: str, spec: ShardSpec | None, keep: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, scale) for keep, (dequantized weight, None) otherwise; a slice reads whole 128-blocks."""
    scale_name = name + SCALE_SUFFIX
    if scale_name not in reader:
        raise CheckpointError(f"{reader.file_of(name)}: FP8 tensor {name} has no {scale_name}")
    block = kernels.BLOCK_SIZE
    if spec is None:
        weight, scale = reader.read(name), reader.read(scale_name, torch.float32)
        return (weight, scale) if keep else (kernels.weight_dequant(weight, scale, out_dtype=dtype), None)
    lo, hi = spec.start // block * block, -(-spec.end // block) * block
    if keep and (lo, min(hi, reader.shape(name)[spec.dim])) != (spec.start, spec.end):
        raise CheckpointError(
            f"{name}: shard [{spec.start}, {spec.end}) along dim {spec.dim} is not aligned to FP8 blocks of "
            f"{block}; pick a parallel layout whose shards are multiples of {block}, or dtype='bfloat16'"
        )
    weight = reader.read(name, dim=spec.dim, start=lo, end=hi)
    scale = reader.read(scale_name, torch.float32, dim=spec.dim, start=lo // block, end=-(-hi // block))
    if keep:
        return weight, scale
    dense = kernels.weight_dequant(weight, scale, out_dtype=dtype)
    return dense.narrow(spec.dim, spec.start - lo, spec.end - spec.start), None


def _load_int_linear(
    module: Linear,
    reader: CheckpointReader,
    name: str,
    expected: tuple[int, ...],
    spec: ShardSpec | None,
    quant: IntQuant,
    device: torch.device,
) -> set[str] | None:
    """Load projection weight `name` as integers: the checkpoint's quantized tensors, or its plain (or
    block-FP8, dequantized) weight quantized now, per rank slice. Returns the tensor names read; None for a
    weight that stays as it is (not a projection: lm_head)."""
    base = name.removesuffix("weight")
    if base + "weight_scale" in reader:
        tensors, used, quant = _read_int(reader, base, expected, spec, quant)
    elif name in reader and is_quantizable(name, reader.shape(name)):
        _check_shape(reader, name, expected, spec)
        # A slice of the input dim (a row-parallel shard) is quantized from whole rows and then cut, so
        # every rank holds one process's integers: an int8 scale covers a whole row, an int4 group may
        # straddle two ranks.
        whole_rows = spec is not None and spec.dim == 1
        read_spec = None if whole_rows else spec
        if reader.is_fp8(name):
            dense = _read_fp8(reader, name, read_spec, False, torch.float32)[0]
            used = {name, name + SCALE_SUFFIX}
        else:
            dense, used = _read(reader, name, read_spec), {name}
        tensors = quantize_weight(dense, quant)
        if whole_rows:
            tensors, quant = _input_columns(tensors, quant, spec, dense.shape[1], name)
    else:
        return None
    module.set_quantized({key: t.to(device) for key, t in tensors.items()}, quant)
    return used


def _input_columns(
    tensors: dict[str, torch.Tensor], quant: IntQuant, spec: ShardSpec, width: int, name: str
) -> tuple[dict[str, torch.Tensor], IntQuant]:
    """Input columns [spec.start, spec.end) of whole quantized rows `width` wide, and the IntQuant they run
    with (int4: the slice's local group size)."""
    if quant.method != "int4":
        return {**tensors, "weight": tensors["weight"][:, spec.start : spec.end].contiguous()}, quant
    group = quant.group_size
    groups = slice(spec.start // group, -(-spec.end // group))
    packed = tensors["weight_packed"][:, spec.start // 2 : spec.end // 2]
    scale, zero = tensors["weight_scale"][:, groups], tensors["weight_zero_point"][:, groups]
    return _int4_slice(packed, scale, zero, quant, spec, width, name)


def _int4_slice(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    quant: IntQuant,
    spec: ShardSpec,
    width: int,
    name: str,
) -> tuple[dict[str, torch.Tensor], IntQuant]:
    try:
        return int4_column_slice(packed, scale, zero, quant, spec.start, spec.end, width)
    except ValueError as e:
        raise CheckpointError(f"{name}: {e}") from None


def _read_int(
    reader: CheckpointReader, base: str, expected: tuple[int, ...], spec: ShardSpec | None, quant: IntQuant
) -> tuple[dict[str, torch.Tensor], set[str], IntQuant]:
    """One projection's stored integer tensors (keyed as `quantize_weight` keys them), sliced to `spec`,
    the names read and the IntQuant they run with: scales follow the output rows; along the input dim an
    int8 scale is whole and an int4 slice keeps the stored groups as local ones (`int4_column_slice`)."""
    row_spec = spec if spec is not None and spec.dim == 0 else None
    if quant.method != "int4":
        weight, scale = base + "weight", base + "weight_scale"
        _check_shape(reader, weight, expected, spec)
        _check_scale_shape(reader, scale, (reader.shape(weight)[0],), "one per output channel")
        tensors = {"weight": _read(reader, weight, spec), "weight_scale": _read(reader, scale, row_spec)}
        return tensors, {weight, scale}, quant
    packed, scale, zero = base + "weight_packed", base + "weight_scale", base + "weight_zero_point"
    rows, half = reader.shape(packed)
    k, group = 2 * half, quant.group_size
    _check_shape(reader, packed, expected, spec, full=(rows, k))
    for other in (scale, zero):
        _check_scale_shape(reader, other, (rows, -(-k // group)), f"groups of {group} (quantization_config)")
    used = {packed, scale, zero}
    if spec is None or spec.dim == 0:
        tensors = {"weight_packed": _read(reader, packed, spec), "weight_scale": _read(reader, scale, spec),
                   "weight_zero_point": _read(reader, zero, spec)}  # fmt: skip
        return tensors, used, quant
    # A row-parallel slice: its bytes, and the groups it touches turned into local ones.
    byte_spec = ShardSpec(1, spec.start // 2, spec.end // 2)
    group_spec = ShardSpec(1, spec.start // group, -(-spec.end // group))
    read = [
        _read(reader, packed, byte_spec),
        _read(reader, scale, group_spec),
        _read(reader, zero, group_spec),
    ]
    tensors, quant = _int4_slice(*read, quant, spec, k, packed)
    return tensors, used, quant


def _check_scale_shape(reader: CheckpointReader, name: str, expected: tuple[int, ...], why: str) -> None:
    if reader.shape(name) != expected:
        raise CheckpointError(
            f"{reader.file_of(name)}: {name} has shape {list(reader.shape(name))}, "
            f"not {list(expected)} for {why}"
        )


def _check_shape(
    reader: CheckpointReader,
    name: str,
    expected: tuple[int, ...],
    spec: ShardSpec | None,
    full: tuple[int, ...] | None = None,
) -> None:
    """`name` holds `expected` (this rank's slice of it under `spec`); `full`: its logical shape when the
    stored one differs (int4: two columns per byte)."""
    if name not in reader:
        raise CheckpointError(
            f"{reader.path}: tensor {name} is missing, but config.json describes a model that needs it "
            "(check num_hidden_layers, first_k_dense_replace, n_routed_experts, q_lora_rank)"
        )
    stored = list(full or reader.shape(name))
    shape = list(stored)
    if spec is not None and spec.end <= shape[spec.dim]:
        shape[spec.dim] = spec.end - spec.start
    if tuple(shape) != expected:
        raise CheckpointError(
            f"{reader.file_of(name)}: tensor {name} has shape {stored} but config.json "
            f"implies {list(expected)}{f' for {spec}' if spec else ''}; the config does not match the tensors"
        )


def _check_all_used(args: ModelArgs, reader: CheckpointReader, used: set[str], skip_mtp: bool) -> None:
    """Every checkpoint tensor must have found a place; leftovers mean config and tensors disagree."""
    n_skipped = args.num_nextn_predict_layers if skip_mtp else 0
    skipped_prefixes = tuple(f"model.layers.{args.num_hidden_layers + k}." for k in range(n_skipped))
    shared = _shared_mtp_copies(args)
    for name in reader.names():
        if (
            name in used
            or name in shared
            or name.endswith(_IGNORED_SUFFIXES)
            or name.startswith(skipped_prefixes)
        ):
            continue
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in used:
            continue
        raise CheckpointError(
            f"{reader.file_of(name)}: tensor {name} is not part of the model config.json describes "
            f"(num_hidden_layers={args.num_hidden_layers}, n_routed_experts={args.n_routed_experts}, "
            f"num_nextn_predict_layers={args.num_nextn_predict_layers}): config and tensors disagree"
        )
