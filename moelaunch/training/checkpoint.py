"""A trained model's weights as Hugging Face DeepSeek-V3 tensors, for the trainer and distillation."""

from __future__ import annotations

import torch

from moelaunch.model.transformer import Transformer, checkpoint_name


def checkpoint_tensors(model: Transformer, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """HF-named tensors: weights in `dtype`, the routing bias kept in fp32 (as DeepSeek-V3 ships it,
    since rounding it would change which experts are chosen)."""
    tensors = {}
    for name, t in model.state_dict().items():
        stored = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        tensors[checkpoint_name(name, model.args)] = t.detach().to(stored).contiguous()
    # DeepSeek-V3's MTP layers carry their own copies of the embedding and the head.
    for k in range(len(model.mtp)):
        prefix = f"model.layers.{model.args.num_hidden_layers + k}."
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return tensors
