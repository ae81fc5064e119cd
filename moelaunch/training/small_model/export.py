"""Write the trained model as a Hugging Face DeepSeek-V3 checkpoint directory, with its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from tokenizers import Tokenizer

from moelaunch.model.transformer import Transformer
from moelaunch.training.checkpoint import checkpoint_tensors
from moelaunch.training.small_model.tokenizer import save_tokenizer


def save_checkpoint(model: Transformer, config: dict[str, Any], tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(tok, out)
