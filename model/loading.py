"""Build a Transformer from a Hugging Face checkpoint directory.

The model is built on the meta device, then every parameter is read from the checkpoint under its
HF name, shape-checked and placed: no random initialization, no second copy of the weights.
Block-FP8 weights are dequantized once at load on the CPU, and kept as FP8 on a GPU (W8A8 GEMM).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from moelaunch import kernels
from moelaunch.model.checkpoint import CheckpointError, CheckpointReader
from moelaunch.model.config import ModelArgs, load_args
from moelaunch.model.linear import Linear
from moelaunch.model.rope import RotaryEmbedding
from moelaunch.model.sharding import ShardSpec
from moelaunch.model.transformer import Transformer, checkpoint_name

log = logging.getLogger(__name__)

Fp8Mode = Literal["auto", "dequant", "keep"]
# Builds the (possibly sharded) module on the meta device: (args, with_mtp) -> Transformer.
ModelBuilder = Callable[[ModelArgs, bool], Transformer]
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
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    fp8: Fp8Mode = "auto",
    with_mtp: bool = True,
    build: ModelBuilder | None = None,
) -> Transformer:
    """Load a DeepSeek-V2/V3 HF checkpoint directory as a ready-to-run Transformer in eval mode.

    fp8: for block-FP8 checkpoints, "keep" runs FP8 weights through the W8A8 kernels, "dequant"
    converts them to `dtype` at load, "auto" keeps them on CUDA and dequantizes elsewhere.
    build: for a parallel rank, builds its shard of the model (layers it holds, slices it owns);
    then only those tensors and slices are read, and unread tensors are expected.
    """
    device = torch.device(device)
    args = load_args(path)
    reader = CheckpointReader(path)
    keep_fp8 = fp8 == "keep" or (fp8 == "auto" and device.type == "cuda")
    mtp_in_checkpoint = has_mtp_weights(args, reader)
    with_mtp = with_mtp and mtp_in_checkpoint
    if args.num_nextn_predict_layers and not with_mtp:
        log.info("%s: no MTP weights loaded; speculative decoding with MTP is off", path)
    with torch.device("meta"):
        model = (build or Transformer)(args, with_mtp)
    used = _fill_from_checkpoint(model, reader, dtype, device, keep_fp8)
    if build is None:
        _check_all_used(args, reader, used, skip_mtp=mtp_in_checkpoint and not with_mtp)
    model.rope = RotaryEmbedding(args).to(device)
    model.checkpoint_bytes_read = reader.bytes_read
    return model.eval().requires_grad_(False)


def _fill_from_checkpoint(
    model: Transformer, reader: CheckpointReader, dtype: torch.dtype, device: torch.device, keep_fp8: bool
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
            spec = getattr(module, "shard_spec", None) if attr == "weight" else None
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
            f"{block}; pick a parallel layout whose shards are multiples of {block}, or use fp8='dequant'"
        )
    weight = reader.read(name, dim=spec.dim, start=lo, end=hi)
    scale = reader.read(scale_name, torch.float32, dim=spec.dim, start=lo // block, end=-(-hi // block))
    if keep:
        return weight, scale
    dense = kernels.weight_dequant(weight, scale, out_dtype=dtype)
    return dense.narrow(spec.dim, spec.start - lo, spec.end - spec.start), None


def _check_shape(
    reader: CheckpointReader, name: str, expected: tuple[int, ...], spec: ShardSpec | None
) -> None:
    if name not in reader:
        raise CheckpointError(
            f"{reader.path}: tensor {name} is missing, but config.json describes a model that needs it "
            "(check num_hidden_layers, first_k_dense_replace, n_routed_experts, q_lora_rank)"
        )
    shape = list(reader.shape(name))
    if spec is not None and spec.end <= shape[spec.dim]:
        shape[spec.dim] = spec.end - spec.start
    if tuple(shape) != expected:
        raise CheckpointError(
            f"{reader.file_of(name)}: tensor {name} has shape {list(reader.shape(name))} but config.json "
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
