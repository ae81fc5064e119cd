"""Write a trained model as a Hugging Face DeepSeek-V3 checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from moelaunch.model.transformer import Transformer, checkpoint_name
from moelaunch.training.small_model.tokenizer import save_tokenizer


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


def save_checkpoint(model: Transformer, config: dict[str, Any], tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(tok, out)
