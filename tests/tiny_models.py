"""Tiny random DeepSeek checkpoints written by transformers (an implementation nobody here wrote)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

V3_BASE: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    initializer_range=0.1,
)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def make_hf_model(path: Path, family: str = "v3", seed: int = 0, **overrides: Any) -> Path:
    """Save a random DeepseekV3ForCausalLM (or V2, for softmax routing) with non-trivial routing."""
    import transformers

    torch.manual_seed(seed)
    kwargs = {**V3_BASE, **overrides}
    if family == "v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
    else:
        kwargs.pop("num_key_value_heads")
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 1.0)  # decisive routing, so a wrong top-k choice shows in the logits
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    model.save_pretrained(path)
    return path


def add_byte_tokenizer(path: Path) -> Path:
    from moelaunch.text.byte_tokenizer import write_byte_tokenizer

    return write_byte_tokenizer(Path(path))


def add_mtp_layer(path: Path) -> Path:
    """Give a checkpoint an MTP layer (transformers writes none): a copy of the last decoder block with
    eh_proj passing the hidden state through. Untrained, it drafts poorly, which tests the rejections."""
    from safetensors.torch import load_file, save_file

    from moelaunch.model import load_args

    args = load_args(path)
    tensors = load_file(path / "model.safetensors")
    last, mtp = f"model.layers.{args.num_hidden_layers - 1}.", f"model.layers.{args.num_hidden_layers}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name[len(last) :]] = tensors[name].clone()
    dim = args.hidden_size
    eh = torch.zeros(dim, 2 * dim)
    eh[:, dim:] = torch.eye(dim)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = torch.ones(dim)
    tensors[mtp + "eh_proj.weight"] = eh
    save_file(tensors, path / "model.safetensors")
    return path
