"""Read a checkpoint's tensors whole and write a compressed copy as a Hugging Face directory.

Compression rewrites tensors by their checkpoint names, so it works the same on the main layers and
the MTP layers, and writes every tensor back in the dtype it was stored in. The tensors are held in
memory whole: this is for checkpoints that fit in the memory of one machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moelaunch.model.checkpoint import CheckpointReader, copy_side_files
from moelaunch.model.loading import holds_nonfinite
from moelaunch.text.files import is_missing, read_text

WEIGHTS_FILE = "model.safetensors"


def read_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    if is_missing(file):
        raise FileNotFoundError(f"{file} not found: give a Hugging Face checkpoint directory")
    config = json.loads(read_text(file, "config"))
    if config.get("quantization_config"):
        # Pruned quantized blocks would need new scales: compress first, then quantize the result.
        raise ValueError(
            f"{path} is a quantized checkpoint: give the unquantized one (for block-FP8: launch convert "
            "fp8-to-bf16 SRC DST) and quantize what this writes"
        )
    return config


def check_finite(path: str | Path) -> None:
    """Refuse a checkpoint holding NaN or inf values: a compressed copy would be as broken, and its
    calibration meaningless. Reads one tensor at a time."""
    reader = CheckpointReader(path)
    broken = [name for name in reader.names() if holds_nonfinite(reader.read(name))]
    if broken:
        named = ", ".join(broken[:4]) + (", ..." if len(broken) > 4 else "")
        raise ValueError(
            f"{path} holds NaN or inf values in {len(broken)} tensor(s) ({named}): nothing was written; "
            "fix or replace the checkpoint (check the download, or the conversion or training that wrote it)"
        )


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, in its stored dtype."""
    reader = CheckpointReader(path)
    return {name: reader.read(name) for name in reader.names()}


def write_checkpoint(
    src: str | Path, out: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> Path:
    """Write `tensors` as one safetensors file with `config` and the source's other files (callers
    check the output directory with check_new_checkpoint_dir before the slow part of their work)."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(src, out)
    return out
