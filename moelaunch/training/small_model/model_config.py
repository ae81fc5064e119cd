"""config.json of the small model: a DeepSeek-V3 in miniature, written the way DeepSeek-V3's reads.

Every V3 feature is on: MLA with a query LoRA and a latent cache, a dense layer then MoE layers,
sigmoid group-limited routing with noaux_tc, a shared expert, YaRN, one MTP layer.
"""

from __future__ import annotations

from typing import Any

from moelaunch.tasks.capabilities import MARKER
from moelaunch.training.small_model.tokenizer import BOS_ID, EOS_ID

# The shipped model; `TINY` overrides it for smoke runs of the training script.
# v_head_dim equals the query-key head dim (nope + rope): training attention then runs in torch's fused
# CPU kernel instead of the unfused math path, 1.6x faster a step.
SMALL: dict[str, Any] = dict(
    hidden_size=160,
    intermediate_size=480,
    moe_intermediate_size=160,
    num_hidden_layers=5,
    first_k_dense_replace=1,
    num_attention_heads=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=48,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
)
TINY: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_attention_heads=2,
)


def hf_config(vocab_size: int, tiny: bool = False) -> dict[str, Any]:
    shape = {**SMALL, **(TINY if tiny else {})}
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        **shape,
        "num_key_value_heads": shape["num_attention_heads"],
        "num_nextn_predict_layers": 1,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rope_theta": 10000,
        # YaRN as in DeepSeek-V3 (factor and original length scaled down with the model).
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
        MARKER: True,  # what gives the chat its line about the model's skills
    }
