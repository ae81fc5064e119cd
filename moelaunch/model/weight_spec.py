"""Which weights a model runs with and how: the checkpoint, the dtype they are held in, quantization at
load and where the routed experts live. One spec travels whole from `LLM(...)` or the deployment file
to every rank's loader (as JSON)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from moelaunch.model.quantization import check_quantization

# auto: bfloat16 on GPUs, where block-FP8 checkpoints keep their FP8 projections; float32 on the CPU.
# bfloat16 | float32: every weight in that dtype, FP8 dequantized at load (bfloat16 on the CPU: the
# projections, embedding and cache; norms, router and activations stay fp32, see compute_dtype).
# fp8: block-FP8 projections kept as stored and run by the W8A8 kernels, the rest as under auto.
WeightDtype = Literal["auto", "bfloat16", "float32", "fp8"]
WEIGHT_DTYPES: tuple[str, ...] = get_args(WeightDtype)


@dataclass(frozen=True)
class WeightSpec:
    model: str  # a Hugging Face checkpoint directory
    dtype: WeightDtype = "auto"
    quantization: str = "none"  # none | int8 | w8a8 | int4: projections quantized at load
    expert_placement: list[list[int]] | None = None  # expert -> EP ranks holding it (copies allowed)
    # Per MoE layer, overriding expert_placement there: decoder layer index (a string: the spec travels
    # as JSON) -> expert -> EP ranks; from parallel.expert_placement_file.
    layer_expert_placement: dict[str, list[list[int]]] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {', '.join(WEIGHT_DTYPES)}")
        check_quantization(self.quantization)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype activations, norms and the router take on `device`.

        bfloat16 on the CPU computes in fp32 from bf16 projection weights: the CPU kernels read bf16
        weights as stored (half the bytes of fp32) and multiply in fp32, and larger products go to
        oneDNN's bf16 GEMM (AMX where the CPU has it); bf16 activations instead cost a conversion on the
        way into and out of every kernel and ran at half the speed of fp32."""
        if self.dtype in ("auto", "fp8"):
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype == "bfloat16" and device.type == "cpu":
            return torch.float32
        return getattr(torch, self.dtype)

    def weight_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype unquantized projection and embedding weights (and the KV cache) are held in."""
        return torch.bfloat16 if self.dtype == "bfloat16" else self.compute_dtype(device)

    def keeps_fp8(self, device: torch.device) -> bool:
        """Whether block-FP8 projections stay FP8 on `device` rather than being dequantized."""
        return self.dtype == "fp8" or (self.dtype == "auto" and device.type == "cuda")
