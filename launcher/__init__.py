"""What a user touches: the `launch` CLI, the Python API, the engine and front ends."""

from .engine.sampling_params import SamplingParams
from .llm import LLM

__all__ = ["LLM", "SamplingParams"]
