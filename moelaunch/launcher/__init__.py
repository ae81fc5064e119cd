"""What a user touches: the `launch` CLI, the Python API, the engine and front ends."""

from moelaunch.engine.llm import LLM
from moelaunch.engine.sampling_params import SamplingParams
from moelaunch.text.reasoning import split_reasoning

__all__ = ["LLM", "SamplingParams", "split_reasoning"]
