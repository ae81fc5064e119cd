"""What a user touches: the `launch` CLI, the Python API, the engine and front ends."""

from moelaunch.launcher.api import LLM
from moelaunch.launcher.engine.sampling_params import SamplingParams
from moelaunch.model.reasoning import split_reasoning

__all__ = ["LLM", "SamplingParams", "split_reasoning"]
