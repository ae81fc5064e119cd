"""DeepSeek-V3 in plain torch, loading Hugging Face checkpoints unchanged."""

from moelaunch.model.checkpoint import CheckpointError, CheckpointReader
from moelaunch.model.config import ConfigError, ModelArgs, args_from_hf_config, load_args
from moelaunch.model.kv_cache import PagedLatentCache, SparseAttention
from moelaunch.model.loading import load_model
from moelaunch.model.transformer import Transformer

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "ConfigError",
    "PagedLatentCache",
    "SparseAttention",
    "ModelArgs",
    "Transformer",
    "args_from_hf_config",
    "load_args",
    "load_model",
]
