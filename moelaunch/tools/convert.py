"""Checkpoint conversions between block-FP8, integer-quantized and plain (bf16/fp32) Hugging Face
directories.

All work shard by shard, so converting a 671B checkpoint needs the memory of one shard, and all keep
shard file names and tensor names, but for the quantization tensors: `*_scale_inv` (FP8), `*.weight_scale`
(int8), and int4's `*.weight_packed`, `*.weight_scale`, `*.weight_zero_point` in place of `*.weight`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from moelaunch import kernels
from moelaunch.model.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    check_new_checkpoint_dir,
    copy_side_files,
)
from moelaunch.model.config import load_args
from moelaunch.model.quantization import (
    IntQuant,
    is_fp8_in_deepseek_checkpoints,
    is_quantizable,
    quantize_weight,
    stored_quantization,
)
from moelaunch.text.files import read_text

SCALE_SUFFIX = "_scale_inv"
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}

ShardFn = Callable[[CheckpointReader, list[str]], dict[str, torch.Tensor]]


def fp8_to_bf16(src: str | Path, dst: str | Path) -> Path:
    """Write `dequant(W, S)` in bf16 under the same names, without the scale tensors."""

    def shard(reader: CheckpointReader, names: list[str]) -> dict[str, torch.Tensor]:
        return {
            name: _read_plain(reader, name, torch.bfloat16)
            for name in names
            if not name.endswith(SCALE_SUFFIX)
        }

    return _convert(src, dst, shard, lambda cfg: {k: v for k, v in cfg.items() if k != "quantization_config"})


def quantize_fp8(src: str | Path, dst: str | Path) -> Path:
    """Make a block-FP8 checkpoint as DeepSeek's are: 128x128 block scales for the projections and
    kv_a_proj_with_mqa (what `launch plan` counts as FP8), bf16 for the rest."""

    def shard(reader: CheckpointReader, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            tensor = reader.read(name)
            if reader.is_fp8(name):
                raise CheckpointError(f"{reader.file_of(name)}: {name} is already FP8; nothing to quantize")
            if is_fp8_in_deepseek_checkpoints(name, tuple(tensor.shape)):
                out[name], out[name + SCALE_SUFFIX] = kernels.weight_quant(tensor.float())
            elif name.endswith("e_score_correction_bias"):
                out[name] = tensor.float()
            else:
                out[name] = tensor.to(torch.bfloat16)
        return out

    return _convert(src, dst, shard, lambda cfg: {**cfg, "quantization_config": FP8_QUANTIZATION_CONFIG})


def quantize_int(src: str | Path, dst: str | Path, quant: IntQuant) -> Path:
    """Quantize the projections to int8 or int4 (a block-FP8 source is dequantized first); every other
    tensor keeps its dtype, so the result runs exactly as `load_model(src, quantization=...)` does."""
    stored = stored_quantization(load_args(src).quantization)
    if stored is not None:
        raise CheckpointError(f"{src} is already quantized ({stored.method}); convert the unquantized one")

    def shard(reader: CheckpointReader, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            if name.endswith(SCALE_SUFFIX):
                continue
            tensor = _read_plain(reader, name, torch.float32)
            if is_quantizable(name, tuple(tensor.shape)):
                base = name.removesuffix("weight")
                out |= {base + key: t for key, t in quantize_weight(tensor, quant).items()}
            else:
                # An FP8 tensor quantization leaves alone (kv_a_proj_with_mqa) is written dequantized in
                # fp32, which is exact (an e4m3 value times an fp32 scale): it loads as it does from the
                # FP8 source, in whatever compute dtype.
                out[name] = tensor
        return out

    return _convert(src, dst, shard, lambda cfg: {**cfg, "quantization_config": quant.config()})


def quantize_int8(src: str | Path, dst: str | Path) -> Path:
    return quantize_int(src, dst, IntQuant("int8"))


def quantize_w8a8(src: str | Path, dst: str | Path) -> Path:
    return quantize_int(src, dst, IntQuant("w8a8"))


def quantize_int4(src: str | Path, dst: str | Path, group_size: int = kernels.INT4_GROUP_SIZE) -> Path:
    return quantize_int(src, dst, IntQuant("int4", group_size))


def _read_plain(reader: CheckpointReader, name: str, fp8_to: torch.dtype) -> torch.Tensor:
    """A tensor as stored, or for an FP8 one its dequantized values in `fp8_to`."""
    tensor = reader.read(name)
    if reader.is_fp8(name):
        tensor = kernels.weight_dequant(
            tensor, reader.read(name + SCALE_SUFFIX, torch.float32), out_dtype=fp8_to
        )
    return tensor


def _convert(
    src: str | Path, dst: str | Path, shard_fn: ShardFn, edit_config: Callable[[dict], dict]
) -> Path:
    src, dst = Path(src), Path(dst)
    reader = CheckpointReader(src)
    config = json.loads(read_text(src / "config.json", "config"))  # read before anything is written
    check_new_checkpoint_dir(src, dst)
    dst.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[str]] = {}
    for name, file in reader.weight_map.items():
        by_file.setdefault(file, []).append(name)
    weight_map: dict[str, str] = {}
    for file, names in sorted(by_file.items()):
        tensors = shard_fn(reader, names)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if (src / INDEX_FILE).exists():
        index = json.loads((src / INDEX_FILE).read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(edit_config(config), indent=2) + "\n")
    copy_side_files(src, dst)
    return dst
