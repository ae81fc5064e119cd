"""Build a Transformer from a Hugging Face checkpoint directory.

The model is built on the meta device, then every parameter is read from the checkpoint under its
HF name, shape-checked and placed: no random initialization, no second copy of the weights.
Block-FP8 weights are dequantized once at load on the CPU, and kept as FP8 on a GPU (W8A8 GEMM).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from torch import nn

import kernels

from .checkpoint import CheckpointError, CheckpointReader
from .config import ModelArgs, load_args
from .linear import Linear
from .rope import RotaryEmbedding
from .transformer import Transformer, checkpoint_name

log = logging.getLogger(__name__)

Fp8Mode = Literal["auto", "dequant", "keep"]
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
) -> Transformer:
    """Load a DeepSeek-V2/V3 HF checkpoint directory as a ready-to-run Transformer in eval mode.

    fp8: for block-FP8 checkpoints, "keep" runs FP8 weights through the W8A8 kernels, "dequant"
    converts them to `dtype` at load, "auto" keeps them on CUDA and dequantizes elsewhere.
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
        model = Transformer(args, with_mtp=with_mtp)
    used = _fill_from_checkpoint(model, reader, dtype, device, keep_fp8)
    _check_all_used(args, reader, used, skip_mtp=mtp_in_checkpoint and not with_mtp)
    model.rope = RotaryEmbedding(args).to(device)
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
            tensor = _read_checked(reader, name, tuple(current.shape))
            used.add(name)
            if reader.is_fp8(name):
                scale_name = name + SCALE_SUFFIX
                if scale_name not in reader:
                    raise CheckpointError(f"{reader.file_of(name)}: FP8 tensor {name} has no {scale_name}")
                scale = reader.read(scale_name, torch.float32)
                used.add(scale_name)
                if keep_fp8 and isinstance(module, Linear):
                    module.weight_scale_inv = scale.to(device)
                    tensor = tensor.to(device)
                else:
                    tensor = kernels.weight_dequant(tensor, scale, out_dtype=dtype)
            elif attr == "e_score_correction_bias":
                tensor = tensor.float()  # routing decisions stay in fp32 whatever the model dtype
            else:
                tensor = tensor.to(dtype)
            tensor = tensor.to(device)
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                module._buffers[attr] = tensor
    return used


def _read_checked(reader: CheckpointReader, name: str, expected: tuple[int, ...]) -> torch.Tensor:
    if name not in reader:
        raise CheckpointError(
            f"{reader.path}: tensor {name} is missing, but config.json describes a model that needs it "
            "(check num_hidden_layers, first_k_dense_replace, n_routed_experts, q_lora_rank)"
        )
    shape = reader.shape(name)
    if shape != expected:
        raise CheckpointError(
            f"{reader.file_of(name)}: tensor {name} has shape {list(shape)} but config.json implies "
            f"{list(expected)}; the config does not match the tensors"
        )
    return reader.read(name)


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
