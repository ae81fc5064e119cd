"""Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: on CPU tensors, for tests).

The interpreter computes with numpy, whose float->fp8 and float->bf16 casts are wrong, so the kernels
store fp32 there and torch casts; on a GPU they store the final dtype.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
