"""What a user touches: the `launch` CLI, the Python API, the engine and front ends."""

from .own_kernels import require_own_kernels

require_own_kernels()  # before anything below imports `kernels`

from .engine.sampling_params import SamplingParams  # noqa: E402
from .llm import LLM  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
