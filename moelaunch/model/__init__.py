"""DeepSeek-V3 in plain torch, loading Hugging Face checkpoints unchanged."""

from moelaunch.model.checkpoint import CheckpointError, CheckpointReader
from moelaunch.model.config import ConfigError, ModelArgs, args_from_hf_config, load_args
from moelaunch.model.kv_cache import PagedLatentCache, SparseAttention
from moelaunch.model.loading import load_model
from moelaunch.model.transformer import Transformer
from moelaunch.model.weight_spec import WeightSpec

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "ConfigError",
    "PagedLatentCache",
    "SparseAttention",
    "ModelArgs",
    "Transformer",
    "WeightSpec",
    "args_from_hf_config",
    "load_args",
    "load_model",
]
