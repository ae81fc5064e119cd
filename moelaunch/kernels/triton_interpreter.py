"""Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: on CPU tensors, for tests).

The interpreter computes with numpy, whose float->fp8 and float->bf16 casts are wrong, so the kernels
store fp32 there and torch casts; on a GPU they store the final dtype.
"""

from __future__ import annotations

import os

import torch

# The interpreter has no SMs: a small nominal count keeps the kernels' split paths in use at test sizes.
INTERPRETER_SMS = 8


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def sm_count(device: torch.device) -> int:
    """The SMs a launch on `device` can fill (splits over the sequence or K are sized from it)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
