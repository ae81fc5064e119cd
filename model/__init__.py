"""DeepSeek-V3 in plain torch, loading Hugging Face checkpoints unchanged."""

from .checkpoint import CheckpointError, CheckpointReader
from .config import ConfigError, ModelArgs, args_from_hf_config, load_args
from .kv_cache import PagedLatentCache
from .loading import load_model
from .transformer import Transformer

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "ConfigError",
    "PagedLatentCache",
    "ModelArgs",
    "Transformer",
    "args_from_hf_config",
    "load_args",
    "load_model",
]
